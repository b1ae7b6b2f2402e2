"""CPU load on demand, for benches that must be measured under load as well as quiet (issue 25: load 4).

`burning(n)` runs n processes that spin on the CPU for as long as the block runs; `LoadSampler` samples
the 1-minute load average every second, so a bench reports the load its figures were taken under (the
load average lags: it takes about a minute to climb to n)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

SPIN = "while True: pass"


@contextlib.contextmanager
def burning(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` spinning processes (their own Python, no work shared with the caller) while the block runs; killed
    and reaped when it ends."""
    assert n >= 0
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL) for _ in range(n)]
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
