"""`kvledger bench scale`: a small run gives every contract key for both designs, and reuses its stores."""

import json
import subprocess
import sys

import pytest

KEYS = ("open_s", "rss_bytes", "check_ms_1m", "put_p99_ms", "put_floor_p99_ms", "put_cpu_ms", "gc_s", "max_stall_ms")


def test_bad_input_exits_2(run_cli, tmp_path):
    r = run_cli("bench", "scale", "--blocks", "100", "--dir", str(tmp_path), "--json")
    assert r.returncode == 2 and r.stdout == "" and "--blocks" in r.stderr
    for burners in ("-1", "nan", "inf"):
        r = run_cli("bench", "scale", "--burners", burners, "--dir", str(tmp_path), "--json")
        assert r.returncode == 2 and r.stdout == "" and "--burners" in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.slow
def test_small_run_both_designs_side_by_side(run_cli, tmp_path):
    args = ("bench", "scale", "--json", "--blocks", "8192", "--old-blocks", "8192", "--dir", str(tmp_path),
            "--puts", "20", "--check-reps", "3", "--gc-blocks", "640")
    r = run_cli(*args, timeout=900)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for design in (res, res["old"]):
        for k in KEYS:
            assert isinstance(design[k], float | int) and design[k] >= 0, k
        assert design["check_found_blocks"] == 8192 and design["build_reused"] is False
    assert res["gc_expired"] == 640 and res["gc_idle_expired"] == 0   # the victims, and nothing else
    assert res["old"]["blocks"] == 8192 and res["fsync_p99_ms"] > 0
    assert res["index_cached"] > 0.95 and "index_cached" not in res["old"]   # warmed: the new index only
    slowest = res["stall_slowest"]   # the longest stall, taken apart
    assert slowest["kind"] in ("put", "check") and slowest["wall_ms"] == res["max_stall_ms"]
    assert 0 <= slowest["cpu_ms"] <= slowest["wall_ms"] + 1.0
    assert "pin_mode" not in res and 0 < res["index_cached_after"] <= 1
    again = json.loads(run_cli(*args, "--pin-index", timeout=900).stdout)   # as `kvledger serve` keeps it
    assert again["build_reused"] is True and again["old"]["build_reused"] is True
    assert again["pin_mode"] == again["old"]["pin_mode"] == "locked" and again["pin_s"] >= 0


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a PID 1 that never reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigterm_stops_the_bench_and_every_process_it_started(tmp_path):
    """`kill` of a bench under load ends it as Ctrl-C would: its burners and role processes go with it (Python's
    default for SIGTERM left them spinning, and the next run measured their load as well as its own)."""
    import os
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "kvledger", "bench", "scale", "--blocks", "200000", "--old-blocks", "0",
                          "--burners", "1.5", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while len(_children(p.pid)) < 2 and time.monotonic() < deadline:   # the burners are up
        time.sleep(0.1)
    children = _children(p.pid)
    assert len(children) >= 2, "the bench started no burners"
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, children)), children
