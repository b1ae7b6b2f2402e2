"""`kvledger store stats|gc|verify` on a file store and on Redis; bad input exits 2."""

import json
import os

from kvledger.store import segment as sg
from kvledger.store.ledger import BlockLedger

from .conftest import BLOCK, chain


def _fill(path):
    with BlockLedger.open(path=path, fsync=False) as led:
        k1, b1 = chain(6, "a")
        led.put_chain(k1, b1, namespace="a", ttl_class="agent")
        k2, b2 = chain(4, "b")
        led.put_chain(k2, b2, namespace="b")


def test_stats_gc_verify_file(run_cli, tmp_path):
    _fill(tmp_path)
    r = run_cli("store", "stats", "--path", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert (st["blocks"], st["chains"], st["live_bytes"]) == (10, 2, 10 * BLOCK)
    assert st["per_class"] == {"agent": 6, "chatbot": 4} and st["oldest_created"] > 0
    r = run_cli("store", "gc", "--path", str(tmp_path), "--json", "--store-capacity", str(5 * BLOCK))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["evicted"] == 6  # down to 0.9 × 5 blocks, tails first
    seg = next((tmp_path / "segments").rglob("*" + sg.SUFFIX))
    meta = sg.read_meta(os.open(seg, os.O_RDONLY))
    with open(seg, "r+b") as f:
        f.seek(meta.entries[0][5])
        f.write(b"\0\1\2")
    r = run_cli("store", "verify", "--path", str(tmp_path), "--json", "--keep")
    assert json.loads(r.stdout) == {"checked": 4, "bad": 1, "removed": 0, "bytes_checked": 3 * BLOCK}
    r = run_cli("store", "verify", "--path", str(tmp_path), "--json")
    assert json.loads(r.stdout)["removed"] == 1
    r = run_cli("store", "stats", "--path", str(tmp_path))
    assert r.returncode == 0 and "blocks" in r.stdout


def stats_gc_verify(run_cli, url: str, blocks: int) -> dict:
    """`store stats` sees `blocks` blocks of one agent-class chain; `gc` and `verify` print one JSON
    line each. Returns verify's object."""
    r = run_cli("store", "stats", "--redis-url", url, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert (st["blocks"], st["chains"], st["per_class"]) == (blocks, 1, {"agent": blocks})
    for cmd in ("gc", "verify"):
        r = run_cli("store", cmd, "--redis-url", url, "--json")
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr
    return json.loads(r.stdout)


def test_stats_redis(run_cli, redis_server):
    with BlockLedger.open(redis_url=redis_server.url) as led:
        k, b = chain(3)
        led.put_chain(k, b, ttl_class="agent")
    stats_gc_verify(run_cli, redis_server.url, 3)


def test_a_serve_data_dir_and_the_default_one_are_found(run_cli, tmp_path):
    """`kvledger serve --data-dir DATA` keeps its blocks in DATA/blocks: `--path DATA` finds them, and with
    no --path the tools read serve's default data dir ($XDG_DATA_HOME/kvledger/serve)."""
    from kvledger.store.ledger import blocks_dir

    data = tmp_path / "data"
    _fill(blocks_dir(data))
    xdg = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    _fill(blocks_dir(tmp_path / "xdg" / "kvledger" / "serve"))
    for args, env in ((("--path", str(data)), None), (("--path", str(blocks_dir(data))), None), ((), xdg)):
        for cmd in ("stats", "verify", "gc"):
            r = run_cli("store", cmd, *args, "--json", env=env)
            assert r.returncode == 0, (cmd, args, r.stderr)
            if cmd == "stats":
                assert json.loads(r.stdout)["blocks"] == 10
            if cmd == "verify":
                assert json.loads(r.stdout)["checked"] == 10


def test_a_missing_default_data_dir_is_one_line(run_cli, tmp_path):
    r = run_cli("store", "stats", env={"XDG_DATA_HOME": str(tmp_path / "empty")})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvledger: error:")
    assert str(tmp_path / "empty" / "kvledger" / "serve") in r.stderr and "--path" in r.stderr


def test_bad_input_one_line_exit_2(run_cli, tmp_path):
    (tmp_path / "plain").mkdir()
    cases = [
        ("stats", "--path", str(tmp_path / "missing")),
        ("gc", "--path", str(tmp_path / "plain")),
        ("verify", "--redis-url", "redis://127.0.0.1:1/0"),
        ("stats", "--redis-url", "http://nope"),
        ("stats",),   # serve's default data dir does not exist (XDG_DATA_HOME below)
        ("gc", "--path", str(tmp_path), "--batch", "0"),
    ]
    for args in cases:
        r = run_cli("store", *args, "--json", env={"XDG_DATA_HOME": str(tmp_path / "xdg")})
        assert r.returncode == 2 and r.stdout == "", args
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("kvledger: error:"), (args, r.stderr)
