"""`kvledger bench whatif`, short form: a chat workload recorded by a live tiny-v4 server, the what-if's prediction
for a smaller store and a shorter TTL, and a live rerun of each: the token hit rates agree within 0.05.

What a run this short can say, honestly: the smaller store moves the live hit rate a lot (asserted: by more than
0.1), so agreeing on it is a real check; a 4 s TTL moves it a few points only (the shared system prompts are hit
often enough to stay alive, and a session's turns come back within seconds), so agreeing on it mostly checks that
the what-if does not predict a drop the server does not have (what it did before it modelled the engine's device
pool). The routing setting needs a cluster start, and on a shared store moves no hit rate: the full run
(`kvledger bench whatif --record docs/results`, docs/simulator.md) checks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def whatif_bench(run_cli, out: Path, slower: int = 1) -> dict:
    """The short what-if: 52 requests over 30 s, a 4 s TTL. `slower` plays the same trace over that many times the
    time, its TTL stretched alike. Over 15 s with a 2 s TTL, a request served a few hundred ms later than simulated
    turns a hit near the TTL into a miss: in CI a live TTL run read 0.54 against 0.60 predicted with no send over
    0.5 s late; in four runs at 30 s and 4 s on a quiet 2-core machine the TTL setting agreed within 0.011."""
    p = run_cli("bench", "whatif", "--sessions", "16", "--duration", str(30 * slower), "--ttl", f"{4 * slower}s",
                "--settings", "capacity,ttl", "--json", "--out", str(out), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def late_sends(out: dict) -> int:
    """Requests a live run sent after their time (held back by requests still in flight)."""
    return out["baseline"]["live"]["late_sends"] + sum(s["live"]["late_sends"] for s in out["settings"])


@pytest.mark.serial   # the live runs send at the trace's times
def test_the_what_if_predicts_a_live_rerun_within_005(run_cli, tmp_path):
    folder = tmp_path / "first"
    out = whatif_bench(run_cli, folder)
    if late_sends(out):
        # A live run that could not keep to the trace's times (a slow or shared machine fell behind) is not the
        # trace the what-if read, so it compares nothing: run the whole bench once more, at half the speed (with a
        # second process burning a core, this 2-core machine sent 2 of 52 late). The second must be on time.
        folder = tmp_path / "again"
        out = whatif_bench(run_cli, folder, slower=2)
    by = {s["setting"]: s for s in out["settings"]}
    assert set(by) == {"capacity", "ttl"} and out["requests"] == 52
    for name, s in by.items():
        assert abs(s["predicted_token_hit_rate"] - s["live_token_hit_rate"]) <= 0.05, (name, s)
        assert s["agrees"] and s["live"]["late_sends"] == 0
    assert out["baseline"]["live_token_hit_rate"] - by["capacity"]["live_token_hit_rate"] > 0.1   # a real change
    assert abs(out["baseline"]["as_recorded_token_hit_rate"] - out["baseline"]["live_token_hit_rate"]) <= 0.05
    assert out["baseline"]["live"]["late_sends"] == 0
    assert (folder / "baseline-trace" / "requests.jsonl").exists() and (folder / "whatif_bench.json").exists()


def test_bad_flags_are_one_line_exit_2(run_cli):
    for args, message in ((("--settings", "colour"), "--settings"), (("--capacity", "lots"), "--capacity: expected"),
                          (("--ttl", "3"), "--ttl: expected a duration"), (("--engines", "0"), "--engines must be")):
        p = run_cli("bench", "whatif", *args, "--json")
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and p.stdout == "" and len(lines) == 1 and message in lines[0], (args, p.stderr)
