"""The server's own trace (entrypoint/trace_recorder.py): the Mooncake lines `kvledger whatif` reads, hashes only,
rotated under a cap, off by a flag, and never a request's failure (a full disk, a folder that cannot be written)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from kvledger.bench.trace import read_trace
from kvledger.core import ModelSpec, chain_keys
from kvledger.entrypoint.config import TraceSettings
from kvledger.entrypoint.trace_recorder import Finished, TraceRecorder, hash_id, rotated, tenant_id, trace_key
from kvledger.util.serve_process import ServeProcess

TINY = ModelSpec.preset("tiny-v4")
SECRET = bytes(range(32))
LIVE = {"cached_tokens": 0, "ttft_s": 0.1, "engine": None, "hit_kind": "miss", "fetch_bytes": 0, "fetch_s": None,
        "decode_s": 0.2}


def _finished(tokens, output=(), namespace="default", arrival_s=1_800_000_000.0) -> Finished:
    tokens = np.asarray(tokens, dtype=np.uint32)
    return Finished(arrival_s, tokens, list(output), chain_keys(tokens, TINY, namespace), namespace, "chatbot", LIVE)


def _recorder(folder, **settings) -> TraceRecorder:
    return TraceRecorder(folder, TraceSettings(**settings), TINY, {"model": "tiny-v4"}, SECRET)


def test_a_line_is_hashes_only_and_reads_back_as_a_trace(tmp_path):
    tokens = [777_777] * 300
    rec = _recorder(tmp_path / "trace")
    rec.record(_finished(tokens, output=[777_777] * 100, namespace="tenant-secret"))
    assert rec.flush() and rec.written == 1
    rec.close()
    text = (tmp_path / "trace" / "requests.jsonl").read_text()
    assert "777777" not in text and "tenant-secret" not in text   # no token id, no namespace name
    line = json.loads(text)
    assert set(line) == {"timestamp", "input_length", "output_length", "block_tokens", "hash_ids", "output_hash_ids",
                         "ttl_class", "tenant_id", "live"}
    assert line["tenant_id"] == tenant_id(TINY, "tenant-secret", SECRET) == tenant_id(TINY, "tenant-secret#salt-00",
                                                                                      SECRET)
    seq = chain_keys(np.asarray(tokens + [777_777] * 99, dtype=np.uint32), TINY, "tenant-secret")
    assert line["hash_ids"] == [hash_id(k, SECRET) for k in seq[:2]]  # the prompt's 2 full blocks of 128
    assert line["output_hash_ids"] == [hash_id(seq[2], SECRET)]       # (300 + 100 − 1) // 128 = 3 blocks stored
    trace = read_trace(tmp_path / "trace" / "requests.jsonl")
    r = trace.requests[0]
    assert (r.input_length, r.output_length, r.block_tokens, r.ttl_class) == (300, 100, 128, "chatbot")
    assert r.live is not None and r.live.ttft_s == 0.1 and r.arrival_s == 1_800_000_000.0
    assert json.loads((tmp_path / "trace" / "server.json").read_text())["block_tokens"] == 128


def test_identical_prefixes_share_ids_and_namespaces_never_do(tmp_path):
    rec = _recorder(tmp_path / "t")
    a = list(range(1, 400))
    for tokens, ns in ((a, "alpha"), (a[:300] + [9] * 99, "alpha"), (a, "beta")):
        rec.record(_finished(tokens, namespace=ns))
    assert rec.flush()
    rec.close()
    first, edited, other = (json.loads(x)["hash_ids"] for x in (tmp_path / "t" / "requests.jsonl").read_text()
                            .splitlines())
    assert first[:2] == edited[:2] and first[2] != edited[2]    # shared up to the block where they part
    assert not set(first) & set(other)                          # another namespace shares nothing


def test_forget_rewrites_every_file_without_the_tenants_lines(tmp_path):
    """DESIGN rule 12: a forget removes a tenant's lines (its salted namespaces' too) from the current file and the
    rotated ones, on the writer thread, and recording goes on in the current file; a line that names no tenant (an
    older server's) and another tenant's stay."""
    folder = tmp_path / "trace"
    rec = _recorder(folder, file_bytes=4096, files=3)
    for i in range(30):
        rec.record(_finished(list(range(1 + i, 300 + i)), namespace=("acme", "acme#salt-ab", "beta")[i % 3],
                             arrival_s=1_800_000_000.0 + i))
    assert rec.flush()
    (folder / "requests.3.jsonl").write_text('{"timestamp":1,"input_length":1,"output_length":1,"hash_ids":[]}\n')
    assert rec.forget("acme") == 20
    rec.record(_finished(list(range(5, 305)), namespace="beta"))
    assert rec.flush()
    rec.close()
    lines = [json.loads(x) for k in range(4) for x in rotated(folder, k).read_text().splitlines()]
    assert [x.get("tenant_id") for x in lines].count(tenant_id(TINY, "beta", SECRET)) == 11
    assert tenant_id(TINY, "acme", SECRET) not in [x.get("tenant_id") for x in lines] and len(lines) == 12
    assert all(oct(rotated(folder, k).stat().st_mode & 0o777) == "0o600" for k in range(3))


def test_rotation_keeps_the_newest_lines_under_the_cap(tmp_path):
    folder = tmp_path / "trace"
    rec = _recorder(folder, file_bytes=2048, files=2)
    for i in range(60):
        rec.record(_finished(list(range(1 + i, 300 + i)), arrival_s=1_800_000_000.0 + i))
    assert rec.flush()
    rec.close()
    files = sorted(p.name for p in folder.glob("requests*.jsonl"))
    assert files == ["requests.1.jsonl", "requests.2.jsonl", "requests.jsonl"]   # the current one + 2 rotated
    assert all(rotated(folder, k).stat().st_size <= 2048 for k in range(3))
    kept = [r for k in (2, 1, 0) for r in read_trace(rotated(folder, k)).requests]
    times = [r.arrival_s - 1_800_000_000.0 for r in kept]
    assert times == sorted(times) and times[-1] == 59 and len(times) < 60   # the oldest went, the newest stayed
    assert rec.written == 60 and rec.dropped == 0
    rec = _recorder(folder, file_bytes=1024, files=0)                       # a line longer than a file: dropped
    rec.record(_finished(list(range(1, 20_000))))   # 156 ids: ~3 KB
    assert rec.flush() and rec.dropped == 1
    rec.close()


def test_off_by_flag(tmp_path):
    from kvledger.cli import build_parser
    from kvledger.entrypoint.cli import trace_settings

    rec = _recorder(tmp_path / "trace", enabled=False)
    rec.record(_finished(list(range(1, 300))))
    rec.close()
    assert not (tmp_path / "trace").exists()
    for command in (["serve"], ["entrypoint", "--redis-url", "redis://x", "--data-dir", "d"], ["up"]):
        assert not trace_settings(build_parser().parse_args([*command, "--no-trace"])).enabled
        assert trace_settings(build_parser().parse_args(command)).enabled


def test_a_folder_that_cannot_be_written_turns_it_off_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="kvledger.serve"):
        rec = _recorder(blocker / "trace")          # mkdir under a file: ENOTDIR
        rec.record(_finished(list(range(1, 300))))
        rec.close()
    assert not rec.enabled and [r.message for r in caplog.records if "trace recording is off" in r.message]


def test_a_full_disk_never_fails_a_request(tmp_path):
    """A real server whose trace file is /dev/full (every write: ENOSPC): each request is answered as before, and
    the log says once that recording is off."""
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    os.symlink("/dev/full", trace_dir / "requests.jsonl")
    server = ServeProcess(tmp_path / "data", "--trace-dir", str(trace_dir), model="tiny-v4").start()
    try:
        body = {"model": "tiny-v4", "prompt": list(range(1, 400)), "max_tokens": 2, "temperature": 0}
        answers = [server.post("/v1/completions", body) for _ in range(3)]
        assert [status for status, _ in answers] == [200, 200, 200], answers
        assert answers[-1][1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # the cache works as ever
    finally:
        server.stop()
    assert server.tail(20000).count("trace recording is off") == 1, server.tail()


@pytest.mark.parametrize("flags, message", [
    (["--trace-file-bytes", "10"], "--trace-file-bytes must be >= 1024"),
    (["--trace-files", "-1"], "--trace-files >= 0"),
    (["--store-capacity", "lots"], "--store-capacity: expected a size"),
    (["--ttl-classes", "agent=3"], "--ttl-classes: expected a duration with its unit"),
    (["--ttl-classes", "gold=3s"], "--ttl-classes: unknown TTL class 'gold'"),
    (["--gc-interval-s", "-1"], "--gc-interval-s must be >= 0"),
])
def test_bad_flags_are_one_line_and_exit_2(run_cli, tmp_path, flags, message):
    p = run_cli("serve", "--model", "tiny-v4", "--data-dir", str(tmp_path / "d"), *flags, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("kvledger: error: "), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and message in p.stderr, p.stderr


def test_the_trace_key_is_made_once_0600_and_a_cluster_derives_one_from_its_token(tmp_path):
    """Embedded: made on the first start, the same on the next (one trace's ids agree across restarts), refused
    (one line naming the file) when others may read it or it is not a key. A cluster: every entrypoint that
    holds the token has the same key, with no file; another token, another key."""
    import stat

    from kvledger.entrypoint.trace_recorder import KEY_FILE

    first = trace_key(tmp_path / "data", None)
    path = tmp_path / "data" / KEY_FILE
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert trace_key(tmp_path / "data", None) == first
    assert trace_key(tmp_path / "other", None) != first
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"^trace key {path}: readable by group or others"):
        trace_key(tmp_path / "data", None)
    path.write_text("not hex\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=f"^trace key {path}: not 64 hex characters"):
        trace_key(tmp_path / "data", None)
    token = "t" * 64
    assert trace_key(tmp_path / "a", token) == trace_key(tmp_path / "b", token) != trace_key(tmp_path / "a", "u" * 64)
    assert not (tmp_path / "a").exists()


def test_a_key_file_that_cannot_be_used_turns_recording_off_not_the_server(tmp_path, caplog):
    from kvledger.entrypoint.server_state import ServeConfig, ServerState
    from kvledger.entrypoint.trace_recorder import KEY_FILE

    data = tmp_path / "data"
    data.mkdir()
    (data / KEY_FILE).write_text("0" * 64 + "\n")
    (data / KEY_FILE).chmod(0o644)   # not this user's alone: someone else may hold it
    with caplog.at_level(logging.WARNING, logger="kvledger.serve"):
        state = ServerState(ServeConfig(model="tiny-v4", data_dir=data))
    try:
        assert not state.trace.enabled
        assert [r.message for r in caplog.records if "trace recording is off" in r.message and KEY_FILE in r.message]
    finally:
        state.close()


def test_a_guessed_prompt_matches_no_id_of_a_real_servers_trace(tmp_path):
    """Issue 54 item 4: the trace is meant to be shared, and its ids were the chain keys' first 8 bytes (SHA-256
    over model, namespace and tokens, nothing secret), so whoever held it could hash a guessed prompt under a
    guessed namespace and confirm it (3 of 3 blocks matched). A real `kvledger serve` answers a request; its
    trace line's ids are HMACs of the chain keys under the server's key (0600, outside the trace folder, not in
    it): the right guess, hashed without the key, matches none; with it, all."""
    import stat

    from kvledger.entrypoint.trace_recorder import KEY_FILE

    data, prompt = tmp_path / "data", list(range(1, 400))   # 3 full blocks
    server = ServeProcess(data, model="tiny-v4").start()
    try:
        status, _ = server.post("/v1/completions", {"model": "tiny-v4", "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0})
        assert status == 200
    finally:
        assert server.stop() == 0
    ids = json.loads((data / "trace" / "requests.jsonl").read_text())["hash_ids"]
    guessed = chain_keys(np.asarray(prompt, dtype=np.uint32), TINY, "default")   # the open server's namespace
    unkeyed = [int.from_bytes(k[:8], "little") & (2**63 - 1) for k in guessed]   # what the ids were before
    assert len(ids) == 3 and not set(unkeyed) & set(ids)
    key_file = data / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    secret = bytes.fromhex(key_file.read_text())
    assert ids == [hash_id(k, secret) for k in guessed]
    trace_bytes = b"".join(p.read_bytes() for p in (data / "trace").iterdir())
    assert key_file.read_text().strip().encode() not in trace_bytes and secret not in trace_bytes
