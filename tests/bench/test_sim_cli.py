import json

import pytest

from kvledger.bench.trace import DEFAULT_TRACE

SMALL = ("--workload", "chat", "--sessions", "15")


@pytest.mark.parametrize("args", [
    ("--capacity", "lots"),
    ("--swa", "periodic:0"),
    ("--swa", "sometimes"),
    ("--ttl", "agent=x"),
    ("--ttl", "-3"),
    ("--prefill-engines", "0"),
    ("--prefill-tps", "-1"),
    ("--fetch-gbps", "nan"),
    ("--routing", "nearest"),
    ("--trace", "/nonexistent/trace.jsonl"),
    ("--trace", str(DEFAULT_TRACE), "--workload", "chat"),
    ("--workload", "chat", "--sessions", "0"),
    ("--model", "gpt-9"),
    ("--sweep", "colour"),
    ("--sweep", "ttl", "--ideal"),
    ("--sweep", "swa", "--sweep-capacity", "big"),
])
def test_bad_input_is_one_line_exit_2(run_cli, args):
    p = run_cli("bench", "sim", *args, "--json")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvledger: error:")


def test_malformed_trace_and_calibration_are_exit_2(run_cli, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    p = run_cli("bench", "sim", "--trace", str(bad))
    assert p.returncode == 2 and p.stderr.strip() == f"kvledger: error: {bad}:2: missing key 'input_length'"
    cal = tmp_path / "cal.json"
    cal.write_text('{"write_bytes_per_s": 5e9}')
    p = run_cli("bench", "sim", *SMALL, "--calibration", str(cal))
    assert p.returncode == 2 and "read_bytes_per_s" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_calibration_sets_the_fetch_bandwidth(run_cli, tmp_path):
    cal = tmp_path / "store.json"
    cal.write_text(json.dumps({"read": {"read_bytes_per_s": 2.5e9}, "read_ratio": 0.9}))
    slow = json.loads(run_cli("bench", "sim", *SMALL, "--calibration", str(cal), "--json").stdout)
    fast = json.loads(run_cli("bench", "sim", *SMALL, "--fetch-gbps", "100", "--json").stdout)
    assert slow["assumptions"]["fetch_bytes_per_s"] == 2.5e9 and str(cal) in slow["assumptions"]["fetch_source"]
    assert slow["assumptions"]["prefill_tps_source"].startswith("DESIGN.md")
    assert slow["ttft_p50_s"] > fast["ttft_p50_s"]  # same hits, slower fetch
    assert slow["block_hit_rate"] == fast["block_hit_rate"]


def test_run_json_keys_and_out_dir(run_cli, tmp_path):
    p = run_cli("bench", "sim", *SMALL, "--json", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in ("requests", "block_hit_rate", "token_hit_rate", "reuse_ceiling", "ttft_p50_s", "ttft_p99_s",
                "baseline_ttft_p50_s", "store_size_over_time", "assumptions"):
        assert key in out
    assert 0 < out["block_hit_rate"] <= out["reuse_ceiling"] <= 1
    assert out["ttft_p50_s"] < out["baseline_ttft_p50_s"]
    assert json.loads((tmp_path / "sim.json").read_text()) == out
    for png in ("sim_ttft_cdf.png", "sim_store_size.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the generated workload is written as a trace the simulator reads back
    again = run_cli("bench", "sim", "--trace", str(tmp_path / "workload_chat.jsonl"), "--json")
    assert json.loads(again.stdout)["block_hit_rate"] == out["block_hit_rate"]


def test_sweep_table_and_chart(run_cli, tmp_path):
    p = run_cli("bench", "sim", *SMALL, "--sweep", "swa", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "| SWA strategy | capacity (GB) | block hit rate |" in p.stdout
    report = json.loads((tmp_path / "sim_sweep_swa.json").read_text())
    assert [r["swa"] for r in report["rows"]][:7] == ["memory", "memory+replay", "shared", "zero", "periodic:4",
                                                       "periodic:16", "full"]
    full = [r for r in report["rows"] if r["swa"] == "full"]
    assert all(r["snapshot_share_of_hits"] == 1.0 for r in full)
    assert (tmp_path / "sim_sweep_swa.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("sweep", ["ttl", "capacity", "routing", "swa"])
def test_full_trace_sweeps(run_cli, sweep):
    p = run_cli("bench", "sim", "--trace", str(DEFAULT_TRACE), "--sweep", sweep, "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    rows, ceiling = report["rows"], report["reuse_ceiling"]
    assert all(0 <= r["block_hit_rate"] <= ceiling + 1e-12 for r in rows)
    rates = [r["block_hit_rate"] for r in rows]
    if sweep == "ttl":  # none, 7, 3, 1, 0.25 days
        assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]
    if sweep == "capacity":
        assert rates == sorted(rates) and rates[0] < rates[-1]
    if sweep == "routing":
        by = {(r["routing"], r["capacity_gb"]): r["block_hit_rate"] for r in rows}
        assert by[("match", None)] >= by[("affinity", None)] > by[("random", None)]
