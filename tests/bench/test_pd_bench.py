"""`kvledger bench pd`: its input checks and its summary (the hand-off itself: tests/entrypoint/test_cluster.py)."""

import argparse
import subprocess
import sys

import pytest

from kvledger.bench.pd_bench import _summary


@pytest.mark.parametrize("args", [["--model", "tiny-v4"], ["--tokens", "1"], ["--requests", "0"],
                                  ["--model", "no-such-model"]])
def test_bad_input_is_one_line_and_exit_2(args):
    r = subprocess.run([sys.executable, "-m", "kvledger", "bench", "pd", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_summary_sets_the_sides_side_by_side_and_compares_their_replies():
    def row(start, computed, text="ab"):
        return {"ttft_s": 2.0, "decode_start_s": start, "text": text, "decode_cached_tokens": 1000 - computed + 1,
                "decode_computed_tokens": computed}

    rows = {"handoff": [row(0.2, 1), row(0.3, 1), row(0.1, 1)],
            "recompute": [row(0.6, 105), row(0.5, 105), row(0.4, 105, "ac")]}
    r = _summary(argparse.Namespace(model="smollm2-135m", tokens=1000, requests=3), 128, rows)
    assert r["tail_tokens"] == 104 and r["sides"]["handoff"]["decode_computed_tokens"] == [1]
    assert r["sides"]["recompute"]["decode_start_s"] == {"median": 0.5, "min": 0.4, "max": 0.6}
    assert r["decode_start_ratio"] == 0.4 and r["replies_equal"] is False
