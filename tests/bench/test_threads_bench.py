"""`kvledger bench threads`: a real `kvledger serve` per thread count and load, every hit a hit, the figures side by
side; its input checks."""

import json
import subprocess
import sys

import pytest


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger", "bench", "threads", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_each_thread_count_is_served_quiet_and_loaded_side_by_side():
    r = _bench("--model", "tiny-v4", "--tokens", "300", "--repeat", "2", "--output-tokens", "4",
               "--threads-list", "1,2", "--burners", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [(row["burners"], row["threads"]) for row in out["rows"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for row in out["rows"]:
        for fig in ("cold_ttft_s", "hit_ttft_s", "tpot_s"):
            s = row[fig]
            assert 0 < s["min"] <= s["median"] <= s["max"], (fig, row)
    assert set(out["fastest"]) == {"burners_0", "burners_1"}
    assert all(set(f.values()) <= {1, 2} for f in out["fastest"].values())


@pytest.mark.parametrize("args", [["--threads-list", "0"], ["--threads-list", "a,b"], ["--burners", "-1"],
                                  ["--tokens", "3"], ["--model", "no-such-model"]])
def test_bad_input_is_one_line_and_exit_2(args):
    r = _bench(*args, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
