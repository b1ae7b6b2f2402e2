"""`kvledger bench serve --against vllm`: its input checks and its summary (the run itself starts vLLM for
minutes: docs/results/ keeps it)."""

import argparse
import subprocess
import sys

import pytest

from kvledger.bench.serve_vllm import _summary


@pytest.mark.parametrize("args", [["--vllm-python", "/no/such/python"], ["--requests", "1"], ["--prefix", "0"]])
def test_bad_input_is_one_line_and_exit_2(args):
    r = subprocess.run([sys.executable, "-m", "kvledger", "bench", "serve", "--against", "vllm", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_ratios_are_kvledger_over_vllm_and_the_first_shared_request_is_not_a_hit():
    def side(cold, first, hit, restart, tpot):
        return {"unshared": {"ttft_s": [cold, cold], "tpot_s": [tpot, tpot]},
                "shared": {"ttft_s": [first, hit, hit], "tpot_s": [tpot] * 3},
                "restart": {"ttft_s": [restart, hit], "tpot_s": [tpot] * 2}}

    sides = {"kvledger": side(6.0, 6.0, 1.5, 1.5, 0.12), "vllm": side(5.0, 5.0, 1.0, 5.0, 0.08)}
    r = _summary(argparse.Namespace(prefix=2048, suffix=256, output_tokens=16, requests=3), "smollm2-135m", sides)
    assert r["sides"]["vllm"]["hit_ttft"] == {"p50_ms": 1000.0, "p99_ms": 1000.0, "n": 2}
    assert (r["hit_ttft_ratio"], r["cold_ttft_ratio"], r["tpot_ratio"], r["restart_ttft_ratio"]) == (
        1.5, 1.2, 1.5, 0.3)
