"""The load a bench measures under: burners spin while the block runs and are gone after it."""

import os
import time
from pathlib import Path

import pytest

from kvledger.util.cpu_load import LoadSampler, burning


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (/proc/PID/stat fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_burners_spin_while_the_block_runs_and_are_reaped_after():
    with burning(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        time.sleep(1.0)
        assert all(_cpu_s(p.pid) > 0.1 for p in procs)   # spinning, not sleeping
    assert all(p.returncode is not None for p in procs)   # killed and reaped
    assert not any(Path(f"/proc/{p.pid}").exists() for p in procs)


@pytest.mark.serial   # a share of a core, which another worker's tests would take from
def test_a_fractional_burner_spins_that_share_of_the_time():
    with burning(1.4) as procs:
        assert len(procs) == 2
        start = [_cpu_s(p.pid) for p in procs]
        time.sleep(3.0)
        used = [(_cpu_s(p.pid) - s) / 3.0 for p, s in zip(procs, start)]
    assert used[0] > 0.6, used   # the whole one: a core, less what the machine's other processes take
    assert 0.2 < used[1] < 0.6, used   # the fraction: 0.4 of a core, give or take the scheduler
    assert not any(Path(f"/proc/{p.pid}").exists() for p in procs)


def test_the_sampler_reports_the_load_average_it_saw():
    with LoadSampler(every_s=0.05) as load:
        time.sleep(0.3)
    s = load.summary()
    assert len(load.samples) >= 3 and s["min"] <= s["median"] <= s["max"]
    assert LoadSampler().summary() == {"min": None, "median": None, "max": None}
