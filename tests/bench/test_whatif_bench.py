"""`kvledger bench whatif`, short form: a chat workload recorded by a live tiny-v4 server, the what-if's prediction
for a smaller store and a shorter TTL, and a live rerun of each: the token hit rates agree within 0.05.

What a run this short can say, honestly: the smaller store moves the live hit rate a lot (asserted: by more than
0.1), so agreeing on it is a real check; a 2 s TTL moves it a few points only (the shared system prompts are hit
often enough to stay alive, and a session's turns come back within seconds), so agreeing on it mostly checks that
the what-if does not predict a drop the server does not have (what it did before it modelled the engine's device
pool). The routing setting needs a cluster start, and on a shared store moves no hit rate: the full run
(`kvledger bench whatif --record docs/results`, docs/simulator.md) checks it."""

from __future__ import annotations

import json
import time


def test_the_what_if_predicts_a_live_rerun_within_005(run_cli, tmp_path):
    t0 = time.monotonic()
    p = run_cli("bench", "whatif", "--sessions", "16", "--duration", "15", "--ttl", "2s", "--settings",
                "capacity,ttl", "--json", "--out", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    by = {s["setting"]: s for s in out["settings"]}
    assert set(by) == {"capacity", "ttl"} and out["requests"] == 52
    for name, s in by.items():
        assert abs(s["predicted_token_hit_rate"] - s["live_token_hit_rate"]) <= 0.05, (name, s)
        assert s["agrees"] and s["live"]["late_sends"] == 0
    assert out["baseline"]["live_token_hit_rate"] - by["capacity"]["live_token_hit_rate"] > 0.1   # a real change
    assert abs(out["baseline"]["as_recorded_token_hit_rate"] - out["baseline"]["live_token_hit_rate"]) <= 0.05
    assert (tmp_path / "baseline-trace" / "requests.jsonl").exists() and (tmp_path / "whatif_bench.json").exists()
    assert time.monotonic() - t0 < 120


def test_bad_flags_are_one_line_exit_2(run_cli):
    for args, message in ((("--settings", "colour"), "--settings"), (("--capacity", "lots"), "--capacity: expected"),
                          (("--ttl", "3"), "--ttl: expected a duration"), (("--engines", "0"), "--engines must be")):
        p = run_cli("bench", "whatif", *args, "--json")
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and p.stdout == "" and len(lines) == 1 and message in lines[0], (args, p.stderr)
