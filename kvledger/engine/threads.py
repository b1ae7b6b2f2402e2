"""How many torch threads compute the model: the one choice every command that loads weights shares.

    --threads N          N (> 0)
    $OMP_NUM_THREADS     the ecosystem's setting, where it is set (its first field: "4" of "4,2")
    otherwise            the CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU
                         quota (a container's --cpus)

Measured with `kvledger bench threads` on 2 cores (docs/engine.md "Threads", docs/results/threads-*.json):
on a quiet machine SmolLM2's cold 2,000-token prefill takes 3.66 s at 2 threads and 6.99 s at 1, so a
server uses every CPU it may. With one of the two cores kept busy by another process, 2 threads gain
nothing (6.98 against 7.10 s) and lose 13-17 % on a hit and per output token: torch's threads meet at a
barrier after every operation, and one that is descheduled holds up the rest. So on a machine shared
with other busy processes, give --threads 1 (or fewer threads than the cores left free).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads computing the model (default: $OMP_NUM_THREADS where set, else the CPUs "
                        "this process may run on; 1 on a machine whose other processes keep its cores busy)")


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup v2 quota (`cpu.max`: "max 100000"
    or "QUOTA PERIOD" in microseconds; a fraction of a CPU rounds up). At least 1."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):   # no cgroup v2 (v1, not Linux, no such file): the mask alone
        pass
    return max(cpus, 1)


def resolve_threads(requested: int | None, *, env: dict[str, str] | None = None,
                    cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The thread count: `requested`, else $OMP_NUM_THREADS, else `usable_cpus()`. ValueError (one line) for a
    count below 1 or an OMP_NUM_THREADS that is not one."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested
    omp = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if omp:
        first = omp.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r} is not a thread count (unset it or give --threads)")
        return int(first)
    return usable_cpus(cpu_max)


def threads_per_process(requested: int | None, processes: int, env: dict[str, str] | None = None,
                        cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Each of `processes` co-located engines' thread count (`kvledger up`): `requested` or $OMP_NUM_THREADS as
    `resolve_threads` reads them, else the usable CPUs shared out, at least 1 each."""
    assert processes >= 1, processes
    if requested is not None or (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip():
        return resolve_threads(requested, env=env, cpu_max=cpu_max)
    return max(usable_cpus(cpu_max) // processes, 1)


def set_threads(n: int) -> int:
    """Compute with `n` torch threads from now on, in every thread of this process; the count torch took."""
    import torch

    assert n >= 1, n
    torch.set_num_threads(n)
    return torch.get_num_threads()
