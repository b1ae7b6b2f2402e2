"""CPU load on demand, for benches that must be measured under load as well as quiet (issue 25: load 4).

`burning(n)` runs processes that spin on the CPU for as long as the block runs: ⌊n⌋ all the time and, for a
fraction f = n − ⌊n⌋, one more that spins f of every DUTY_PERIOD_S and sleeps the rest (it adds about f to
the load average, as a process runnable f of the time does). `LoadSampler` samples the 1-minute load
average every second, so a bench reports the load its figures were taken under (the load average lags: it
takes about a minute to climb)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

SPIN = "while True: pass"
DUTY_PERIOD_S = 0.01   # a fractional burner's cycle: short against the scheduler's view, long against a syscall
DUTY = """import time
on, off = {on!r}, {off!r}
while True:
    end = time.perf_counter() + on
    while time.perf_counter() < end:
        pass
    time.sleep(off)
"""


@contextlib.contextmanager
def burning(n: float) -> Iterator[list[subprocess.Popen]]:
    """⌊n⌋ spinning processes, and one spinning n − ⌊n⌋ of the time (each its own Python, no work shared with
    the caller), while the block runs; killed and reaped when it ends."""
    assert n >= 0
    whole, part = int(n), n - int(n)
    codes = [SPIN] * whole
    if part > 1e-6:
        codes.append(DUTY.format(on=part * DUTY_PERIOD_S, off=(1 - part) * DUTY_PERIOD_S))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for code in codes]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


class LoadSampler:
    """The 1-minute load average, sampled every `every_s` seconds from start to stop."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float | None]:
        """min / median / max of the samples (None when none was taken)."""
        s = sorted(self.samples)
        if not s:
            return {"min": None, "median": None, "max": None}
        return {"min": round(s[0], 2), "median": round(s[len(s) // 2], 2), "max": round(s[-1], 2)}
