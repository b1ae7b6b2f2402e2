"""The floor beside a put's p99: burning a put's CPU time in a plain loop; where a slow op's time went."""

import math
import time

from kvledger.bench.scale_roles import OpCost, pressure_ms, spin_ms


def test_spin_burns_the_cpu_time_asked_and_reports_its_wall_time():
    cpu = time.process_time()
    t = time.perf_counter()
    wall_ms = spin_ms(0.02)
    elapsed_ms = (time.perf_counter() - t) * 1e3
    assert time.process_time() - cpu >= 0.02          # the CPU was burnt, not slept
    assert 20.0 <= wall_ms <= elapsed_ms              # wall time ≥ CPU time on one thread; measured inside the call
    assert spin_ms(0.0) < 5.0


def test_an_ops_cost_tells_a_wait_from_its_own_cpu():
    slept = OpCost.of("put", lambda: time.sleep(0.05))
    assert slept.kind == "put" and slept.wall_ms >= 50.0
    assert slept.cpu_ms < 10.0 and slept.voluntary_switches >= 1     # it waited: off the CPU, by its own call
    spun = OpCost.of("check", lambda: spin_ms(0.03))
    assert spun.cpu_ms >= 30.0 and spun.wall_ms >= spun.cpu_ms - 1.0  # its own CPU time, within the clocks' ticks


def test_pressure_totals_only_grow_where_the_kernel_offers_them():
    io0, cpu0 = pressure_ms()
    time.sleep(0.01)
    io1, cpu1 = pressure_ms()
    for before, after in ((io0, io1), (cpu0, cpu1)):
        assert (math.isnan(before) and math.isnan(after)) or after >= before >= 0
