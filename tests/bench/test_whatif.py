"""`kvledger whatif`: the simulator on a recorded trace folder, beside its live figures; one line and exit 2 for
bad input, a missing or an empty trace; a damaged line is a warning naming it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvledger.bench.trace import LiveFigures, TraceRequest, write_trace
from kvledger.bench.whatif import LIVE_LOW_WATERMARK, calibrate, whatif
from kvledger.bench.whatif_trace import load_recorded
from kvledger.core import ModelSpec

SMOL = ModelSpec.preset("smollm2-135m")
SERVER = {"model": "smollm2-135m", "mode": "embedded", "ttl_s": {"agent": 3600.0, "chatbot": 3600.0},
          "store_capacity_bytes": None, "routing": "cache-aware", "replay": False, "block_tokens": 128,
          "device_blocks": 3}   # a device pool too small to hold a conversation: the store decides


def _requests(n: int = 40, start: float = 1_800_000_000.0) -> list[TraceRequest]:
    """n requests, 1 s apart, 4 conversations: each prompt extends its conversation's previous one by a block.
    Live figures as a server with 500 prefill tokens/s and no overhead would measure them."""
    out, chains = [], {c: [] for c in range(4)}
    for i in range(n):
        chain = chains[i % 4]
        chain.append(1000 * (i % 4) + len(chain) + 1)
        ids = tuple(chain)
        cached = (len(ids) - 1) * 128 if len(ids) > 1 else 0
        length = 128 * len(ids) + 5
        live = LiveFigures(cached, (length - cached) / 500.0, None, "full" if cached else "miss", 0, None, 0.5)
        out.append(TraceRequest(start + i, length, 3, ids, 128, live=live))
    return out


def _folder(tmp_path, requests=None, server=SERVER):
    folder = tmp_path / "data" / "trace"
    folder.mkdir(parents=True)
    write_trace(requests if requests is not None else _requests(), folder / "requests.jsonl")
    if server is not None:
        (folder / "server.json").write_text(json.dumps(server))
    return tmp_path / "data"


def test_the_recorded_window_calibrates_the_simulator_and_it_agrees_with_itself(tmp_path):
    recorded = load_recorded(_folder(tmp_path))
    assert recorded.start_epoch_s == 1_800_000_000.0 and recorded.trace.requests[0].arrival_s == 0
    cal = calibrate(recorded.trace.requests, SMOL)
    assert cal.prefill_tokens_per_s == pytest.approx(500.0, rel=1e-6)   # what the TTFTs were made with
    assert cal.decode_tokens_per_s == pytest.approx(4.0) and cal.fetch_source.startswith("assumed")
    report = whatif(recorded, SMOL, capacities=[4 * SMOL.block_bytes(), math.inf])
    assert report["live"]["token_hit_rate"] == pytest.approx(report["as_recorded"]["token_hit_rate"], abs=1e-9)
    assert abs(report["model_error"]["token_hit_rate"]) < 1e-9
    rows = {(r["change"], r["setting"]): r for r in report["rows"]}
    assert rows[("capacity", "unlimited")]["token_hit_rate"] == report["as_recorded"]["token_hit_rate"]
    small = [r for r in report["rows"] if r["change"] == "capacity" and r["setting"] != "unlimited"][0]
    assert small["token_hit_rate"] < report["as_recorded"]["token_hit_rate"] and small["evicted_bytes"] > 0
    assert {r["change"] for r in report["rows"]} == {"capacity", "ttl", "routing"}   # no SWA rows: full attention
    assert report["assumptions"]["low_watermark"] == LIVE_LOW_WATERMARK


def test_the_live_low_watermark_and_device_pool_are_the_servers():
    import inspect

    from kvledger.engine.defaults import DEFAULTS   # what bench/whatif.py reads for an engine's pool
    from kvledger.engine.engine import Engine
    from kvledger.store.lmdb_store import LmdbStore

    assert inspect.signature(LmdbStore.__init__).parameters["low_watermark"].default == LIVE_LOW_WATERMARK
    assert inspect.signature(Engine.__init__).parameters["kv_cache_bytes"].default == DEFAULTS.kv_cache_bytes


def test_json_is_one_object_and_out_writes_the_chart(run_cli, tmp_path):
    data = _folder(tmp_path)
    p = run_cli("whatif", "--trace", str(data), "--json", "--ttl", "2s", "--routing", "round-robin", "--out",
                str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)   # exactly one object: json.loads refuses anything after it
    assert [r["setting"] for r in report["rows"] if r["change"] != "capacity"] == [
        "2 s, every class", "round-robin, 2 engines, shared store"]
    ttl = [r for r in report["rows"] if r["change"] == "ttl"][0]
    assert ttl["token_hit_rate"] < report["as_recorded"]["token_hit_rate"]   # a turn comes back after 4 s
    assert (tmp_path / "out" / "whatif.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "whatif.json").read_text())["requests"] == 40
    p = run_cli("whatif", "--trace", str(data))
    assert p.returncode == 0 and "live (measured)" in p.stdout and "as recorded" in p.stdout


def test_a_damaged_recording_is_read_up_to_the_damage_with_a_warning(run_cli, tmp_path):
    data = _folder(tmp_path)
    rotated = data / "trace" / "requests.1.jsonl"
    write_trace(_requests(4, start=1_700_000_000.0), rotated)
    current = data / "trace" / "requests.jsonl"
    lines = current.read_text().splitlines(keepends=True)
    current.write_text("".join(lines[:10]) + lines[10][:25])   # a write cut by a crash
    p = run_cli("whatif", "--trace", str(data), "--json")
    assert p.returncode == 0, p.stderr
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(f"kvledger whatif: warning: {current}:11: not JSON")
    assert p.stderr.strip().endswith("; read the 10 requests before it")
    assert json.loads(p.stdout)["requests"] == 14                 # the rotated file's 4 and the 10 before the damage


@pytest.mark.parametrize("setup, args, message", [
    ("none", (), "no such file or directory"),
    ("empty", (), "the recorded trace has no requests"),
    ("nofiles", (), "no recorded trace here"),
    ("nomodel", (), "names no model"),
    ("ok", ("--capacity", "lots"), "--capacity: expected a size"),
    ("ok", ("--ttl", "30"), "--ttl: expected a duration with its unit"),
    ("ok", ("--ttl", "gold=3s"), "--ttl: unknown TTL class 'gold'"),
    ("ok", ("--routing", "nearest"), "invalid choice"),
    ("ok", ("--last", "0"), "--last must be >= 1"),
    ("ok", ("--model", "gpt-9"), "--model"),
    ("ok", ("--prefill-engines", "1025"), "--prefill-engines must be at most 1024"),   # issue 54: bounds
    ("ok", ("--decode-engines", "1025"), "--decode-engines must be at most 1024"),
    ("ok", ("--capacity", "2000000T"), "--capacity must be at most 1e+18 bytes"),
    ("ok", ("--ttl", "agent=400d"), "--ttl must be at most 365 days"),
    ("ok", ("--routing", "round-robin") * 9, "--routing: at most 8 values"),
])
def test_bad_input_and_no_trace_are_one_line_exit_2(run_cli, tmp_path, setup, args, message):
    data = tmp_path / "data"
    if setup == "empty":
        (data / "trace").mkdir(parents=True)
        (data / "trace" / "requests.jsonl").write_text("")
    elif setup == "nofiles":
        data.mkdir()
    elif setup in ("ok", "nomodel"):
        _folder(tmp_path, server=SERVER if setup == "ok" else None)
    p = run_cli("whatif", "--trace", str(data), *args, "--json")
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvledger: error:") and message in lines[0], p.stderr


def test_without_the_bench_extra_it_runs_and_only_the_chart_is_refused(tmp_path):
    """`GET /whatif` runs `kvledger whatif` where the product runs, without the bench extra (None in sys.modules
    reads as not installed): the report comes; `--out`, whose chart needs matplotlib, is one line and exit 2."""
    data = _folder(tmp_path)
    code = ("import sys\n"
            "sys.modules['matplotlib'] = sys.modules['zmq'] = sys.modules['openai'] = None\n"
            "from kvledger.cli import main\n"
            "main(sys.argv[1:])\n")
    p = subprocess.run([sys.executable, "-c", code, "whatif", "--trace", str(data), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["requests"] == 40, p.stderr
    p = subprocess.run([sys.executable, "-c", code, "whatif", "--trace", str(data), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout, p.stderr.splitlines()) == (2, "", [
        "kvledger: error: --out draws whatif.png with matplotlib, which is not installed: pip install "
        "'kvledger[bench]' (or leave out --out)"])
    assert not (tmp_path / "out").exists()


def test_help_has_defaults_and_an_example(run_cli):
    p = run_cli("whatif", "--help")
    assert p.returncode == 0 and "example" in p.stdout and "kvledger whatif --trace" in p.stdout
    assert "(default: 1/2, 1/4, 1/8 of the peak as recorded, and unlimited)" in " ".join(p.stdout.split())


def test_the_prefill_rate_is_fitted_on_requests_alone_in_flight():
    """TTFT = 80 ms + computed / 4000 for a request alone; one queued behind another waits longer, which the
    fit must not read as a slower engine."""
    from kvledger.bench.whatif import marginal_prefill_rate

    def req(t: float, computed: int, ttft: float) -> TraceRequest:
        return TraceRequest(t, computed, 1, (), 128, live=LiveFigures(0, ttft))

    alone = [req(10.0 * k, 128 * (k + 1), 0.08 + 128 * (k + 1) / 4000) for k in range(8)]
    queued = [req(10.0 * k + 0.01, 512, 5.0) for k in range(8)]   # each arrives while the one before computes
    rate, intercept, used = marginal_prefill_rate(sorted(alone + queued, key=lambda r: r.arrival_s))
    assert rate == pytest.approx(4000) and intercept == pytest.approx(0.08) and used == 8
    assert marginal_prefill_rate(alone[:4]) is None                                   # too few to fit
    assert calibrate(alone[:4], SMOL).prefill_source.startswith("recorded timings: computed prompt tokens per busy")
