"""The chaos run's short form (issue 23): the cluster on a real JuiceFS volume (two clients), kvledger's Redis, 2
prefill engines and 1 decode engine (tiny-v4), 3 clients of multi-turn conversations, and each fault kind
once. Every reply is checked against one no-cache engine asked in one request: no wrong answer, no
failed or hung request, no over-claimed cached tokens, and every fault recovered by the cluster itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kvledger.bench.chaos_faults import FAULTS
from kvledger.util.juicefs import fuse_unavailable


@pytest.mark.serial   # each fault's recovery has a deadline
def test_the_short_chaos_run_finds_no_wrong_answer_and_recovers_from_every_fault(tmp_path):
    if (why := fuse_unavailable()) is not None:
        pytest.skip(why)
    run = subprocess.run([sys.executable, "-m", "kvledger", "bench", "chaos", "--short", "--json",
                          "--data-dir", str(tmp_path / "chaos")], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["wrong_answers"] == 0, r["wrong_examples"]
    assert r["unchecked"] == 0
    assert r["failed"] == {}, r["failure_examples"]
    assert r["hung"] == 0 and r["cached_overclaimed"] == 0 and r["manual_restart_needed"] == 0
    assert set(r["max_recovery_s"]) == set(FAULTS)
    assert all(s is not None and s < 120 for s in r["max_recovery_s"].values()), r["max_recovery_s"]
    # the faults hit a cluster in use, and the load went on through them
    assert r["completed"] >= 60 and r["hit_rate"] > 0.3, (r["completed"], r["hit_rate"])
    assert all(t["hit_rate_after"] is not None for t in r["trials"][:-1]), r["trials"]
    notes = {t["kind"]: t["note"] for t in r["trials"]}
    assert "No space left on device" in notes["fill_volume"], notes
    damaged = re.findall(r"(?:corrupt|truncate|delete) (\d+)", notes["damage_segments"])
    assert len(damaged) == 3 and sum(map(int, damaged)) > 0, notes


def test_a_data_dir_left_by_another_run_is_refused(run_cli, tmp_path):
    """Its cluster would serve blocks and states of the last run, maybe computed by another version's floats."""
    (tmp_path / "cluster").mkdir()
    p = run_cli("bench", "chaos", "--short", "--json", "--data-dir", str(tmp_path))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and p.stdout == "" and len(lines) == 1 and "not empty" in lines[0], p.stderr
