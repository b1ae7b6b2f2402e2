"""`kvledger bench replay` against a real `kvledger serve` (SmolLM2): a tiny trace, sent one at a time."""

import json

import numpy as np
import pytest

B = 128


def _line(t_ms: float, length: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": t_ms, "input_length": length, "output_length": 2, "hash_ids": ids,
                       "block_tokens": B})


# A: 3 blocks + 20; B: A's 3 blocks, 2 more, 10 (7 names the partial block); C = B; D, E: unrelated.
# Sent one at a time, 4 s apart or right after the previous answer. A block is visible once the
# writer's put (after prefill, fsynced) is done, so a cold request sits between each writer and its
# reader. B reuses A's 3 blocks; C all 5 of B's (the hit cap ⌊(650 − 1)/128⌋·128 = 640 lets the
# 5th count); A, D and E are cold.
TINY = [_line(0, 3 * B + 20, [1, 2, 3, 4]), _line(4000, B + 72, [8, 9]), _line(8000, 5 * B + 10, [1, 2, 3, 5, 6, 7]),
        _line(12000, B + 50, [10, 11]), _line(16000, 5 * B + 10, [1, 2, 3, 5, 6, 7])]
EXPECTED_PROMPT = [404, 200, 650, 178, 650]
EXPECTED_CACHED = [0, 0, 3 * B, 0, 5 * B]
HEADLINE = {"token_hit_rate", "sim_token_hit_rate", "hit_rate_gap", "ttft_p50_warm_s", "ttft_p50_cold_s",
            "ttft_p99_warm_s", "ttft_p99_cold_s", "requests_per_s", "store_share_of_hits", "prefill_tokens_per_s",
            "read_bytes_per_s", "prefill_tokens_per_s_idle"}
POLICY = HEADLINE | {"routing", "server", "requests", "errors", "prompt_tokens", "cached_tokens",
                     "device_cached_tokens", "store_cached_tokens", "device_share_of_hits", "cold_requests",
                     "warm_requests", "prompt_tokens_per_s", "output_tokens_per_s", "calibration", "sim"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One replay of TINY through `kvledger serve` (SmolLM2): (report, outcomes, out dir)."""
    import subprocess

    from tests.conftest import KVLEDGER

    root = tmp_path_factory.mktemp("replay")
    trace = root / "tiny.jsonl"
    trace.write_text("\n".join(TINY) + "\n")
    out = root / "out"
    p = subprocess.run([str(KVLEDGER), "bench", "replay", "--trace", str(trace), "--launcher", "serve",
                        "--length-scale", "1", "--time-scale", "1", "--max-inflight", "1", "--probe-tokens", "256",
                        "--json", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(p.stdout.strip().splitlines()) == 1
    outcomes = [json.loads(line) for line in (out / "replay_outcomes.jsonl").read_text().splitlines()]
    return json.loads(p.stdout), outcomes, out


def test_report_keys_and_scaling(tiny_run):
    report, _, _ = tiny_run
    assert report.keys() >= HEADLINE and report["bench"] == "replay" and report["routing"] == "cache-aware"
    (policy,) = report["policies"]
    assert policy.keys() >= POLICY, POLICY - policy.keys()
    s = report["scaling"]
    assert (s["length_factor"], s["block_stride"], s["time_factor"], s["requests"]) == (1.0, 1, 1.0, 5)
    assert s["prompt_tokens"] == sum(EXPECTED_PROMPT)
    assert policy["errors"] == 0 and policy["calibration"]["prefill_probe_tokens"] == [128, 256]


def test_hit_rate_arithmetic_matches_the_responses(tiny_run):
    report, outcomes, _ = tiny_run
    policy = report["policies"][0]
    outcomes.sort(key=lambda o: o["index"])
    assert [o["prompt_tokens"] for o in outcomes] == EXPECTED_PROMPT
    assert [o["cached_tokens"] for o in outcomes] == EXPECTED_CACHED
    for o in outcomes:
        assert o["error"] is None and o["completion_tokens"] == 2
        assert o["device_cached_tokens"] + o["store_cached_tokens"] == o["cached_tokens"]
    assert report["token_hit_rate"] == sum(EXPECTED_CACHED) / sum(EXPECTED_PROMPT)
    assert policy["cached_tokens"] == sum(EXPECTED_CACHED)
    assert policy["store_cached_tokens"] == sum(o["store_cached_tokens"] for o in outcomes)
    warm = [o["ttft_s"] for o in outcomes if o["cached_tokens"] > 0]
    cold = [o["ttft_s"] for o in outcomes if o["cached_tokens"] == 0]
    assert (policy["warm_requests"], policy["cold_requests"]) == (2, 3)
    assert report["ttft_p50_warm_s"] == round(float(np.percentile(warm, 50)), 4)
    assert report["ttft_p99_cold_s"] == round(float(np.percentile(cold, 99)), 4)
    assert 0 <= report["sim_token_hit_rate"] <= sum(EXPECTED_CACHED) / sum(EXPECTED_PROMPT)


def test_bench_sim_takes_the_replay_as_calibration(tiny_run, run_cli):
    """`kvledger bench sim` on the written requests, calibrated by the replay's JSON, predicts what the
    replay reported as `sim_token_hit_rate` (the same simulator on the same requests)."""
    report, _, out = tiny_run
    policy = report["policies"][0]
    assumptions = policy["sim"]["assumptions"]
    p = run_cli("bench", "sim", "--trace", str(out / "replay_requests_cache-aware.jsonl"), "--calibration",
                str(out / "replay.json"), "--model", "smollm2-135m", "--ttl", "none", "--prefill-engines", "1",
                "--decode-engines", "1", "--decode-tps", repr(assumptions["decode_tokens_per_s"]), "--json")
    assert p.returncode == 0, p.stderr
    sim = json.loads(p.stdout)
    assert sim["assumptions"]["prefill_tokens_per_s"] == assumptions["prefill_tokens_per_s"]
    assert sim["token_hit_rate"] == pytest.approx(report["sim_token_hit_rate"], abs=1e-12)


@pytest.mark.parametrize("content", ['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                                     '{"timestamp": 1}\n', "not json\n", ""])
def test_bad_trace_is_one_line_exit_2(run_cli, tmp_path, content):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    p = run_cli("bench", "replay", "--trace", str(bad), "--json")
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvledger: error: {bad}")


@pytest.mark.parametrize("args", [("--trace", "/nonexistent/trace.jsonl"), ("--workload", "chat", "--sessions", "0"),
                                  ("--workload", "chat", "--max-inflight", "0"),
                                  ("--workload", "chat", "--out", "/proc/no/such/dir"),
                                  ("--workload", "chat", "--sessions", "1", "--url", "http://127.0.0.1:9"),
                                  ("--workload", "chat", "--length-scale", "0"),
                                  ("--workload", "chat", "--url", "127.0.0.1:8000"),
                                  ("--workload", "chat", "--url", "https://127.0.0.1:8000/v1"),
                                  ("--workload", "chat", "--url", "http://127.0.0.1:9", "--routing", "round-robin",
                                   "least-loaded"), ("--workload", "chat", "--probe-tokens", "9")])
def test_bad_flags_are_one_line_exit_2(run_cli, args):
    p = run_cli("bench", "replay", *args, "--json")
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("kvledger: error:")


@pytest.mark.slow
def test_chat_workload_matches_the_simulator(run_cli):
    """The done-when run: the default chat replay, cache-aware routing, live vs simulated hit rate."""
    p = run_cli("bench", "replay", "--workload", "chat", "--json", timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout)
    print(json.dumps({k: report[k] for k in HEADLINE}))
    assert report["policies"][0]["errors"] == 0
    assert abs(report["token_hit_rate"] - report["sim_token_hit_rate"]) <= 0.05
    assert report["ttft_p50_warm_s"] is not None and report["ttft_p50_cold_s"] is not None
