"""`kvledger bench misses`, tiny: the JSON's shape and that each case found what it was built to find."""

import json


def test_bench_misses_json(run_cli):
    r = run_cli("bench", "misses", "--json", "--reps", "5", "--tokens", "512", "--sample-prompt-tokens", "4096",
                "--no-redis")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cases = out["stores"]["embedded"]["512"]
    assert cases["hit"]["cause"] is None and cases["diverged"]["cause"] == "diverged"
    assert cases["diverged"]["divergence"] == 256
    for c in cases.values():
        assert c["on"]["p50_ms"] > 0 and c["off"]["p50_ms"] > 0 and c["on_over_off_p50"] > 0
    s = out["sample"]
    assert 0 < s["sample_bytes"] <= s["traced_bytes"] and s["sample_bytes"] <= s["cap_tokens"] * (4 + 16 / 128)
    r = run_cli("bench", "misses", "--tokens", "12")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
