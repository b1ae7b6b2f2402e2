"""The floor beside a put's p99: burning a put's CPU time in a plain loop."""

import time

from kvledger.bench.scale_roles import spin_ms


def test_spin_burns_the_cpu_time_asked_and_reports_its_wall_time():
    cpu = time.process_time()
    t = time.perf_counter()
    wall_ms = spin_ms(0.02)
    elapsed_ms = (time.perf_counter() - t) * 1e3
    assert time.process_time() - cpu >= 0.02          # the CPU was burnt, not slept
    assert 20.0 <= wall_ms <= elapsed_ms              # wall time ≥ CPU time on one thread; measured inside the call
    assert spin_ms(0.0) < 5.0
