"""How many torch threads compute the model: the one choice every command that loads weights shares.

    --threads N          N (> 0)
    $OMP_NUM_THREADS     the ecosystem's setting, where it is set (its first field: "4" of "4,2")
    otherwise            the CPUs this process may run on (its affinity mask, capped by a cgroup v2 CPU quota:
                         a container's --cpus), less one left to everything else where at least two remain
                         (`default_threads`: 15 of 16, 2 of 2)

Measured with `kvledger bench threads`, SmolLM2, 2,000-token prompts (docs/engine.md "Threads",
docs/results/threads-*.json, 2026-12-04):
- 2 cores, quiet: the cold prefill takes 5.09 s on 2 threads and 8.75 s on 1, so a small machine computes on
  every CPU it has. With one of the two cores kept busy by another process, 2 threads are slower on
  everything, 3x per output token (263 against 88 ms).
- 16 cores (Intel Xeon), quiet: 15 threads against 16, cold 0.94 against 0.88 s, but per output token 37
  against 45 ms and a hit 0.117 against 0.131 s. With one core kept busy, 16 threads fall apart (cold 7.7 s,
  372 ms per token) and 15 do not notice (0.89 s, 37 ms).
torch's threads meet at a barrier after every operation and their workers spin while they wait, so one
that is descheduled holds up the rest: a thread count above the cores left free costs up to 10x. Leaving
one CPU free keeps the server's own threads (the HTTP loop, the fetcher, the writer) and a stray process
off the computing cores; vLLM's CPU backend reserves one core the same way. On a machine shared with other
busy processes, give --threads 1 (or fewer threads than the cores left free).

Idle OpenMP workers spin briefly (`limit_spinning`): every `kvledger` process computes with GOMP_SPINCOUNT=2000 unless
the user chose how OpenMP waits (OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME set). A worker that reaches the
barrier at the end of a parallel region spins before it sleeps, by default 300,000 times (milliseconds). When
another process keeps a core busy, the spinning worker takes CPU time from the thread it waits for, and each of a
step's hundreds of regions waits for a timeslice. Sleeping at once (PASSIVE) ends that, but then every region
pays a wake-up, and Gemma 3's fixed-row products are thousands of small regions. 2,000 spins (tens of
microseconds here) bridge the gap between two regions of one step and give the core up soon after. Measured with
`kvledger bench threads`, 1,000-token prompts, 32 output tokens, 2 threads on the 2-core Xeon, one process
spinning on a core or none (docs/engine.md "Threads", 2026-12-07), cold TTFT / hit TTFT / TPOT against the best
thread count under the same load:
- Gemma 3, a core busy: 300,000 spins 6.6x / 7.7x / 5.5x; 2,000: 1.57x / 1.45x / 1.26x; PASSIVE 1.06x / 1.03x / 0.92x.
- Gemma 3, quiet, against 300,000 spins (two runs each): 2,000 spins 1.09x / 1.17x / 1.09x; PASSIVE 1.61x / 1.67x /
  1.36x.
A spin is a PAUSE instruction, whose length differs by CPU (shorter on AMD's), so elsewhere 2,000 spins sit
nearer PASSIVE. A runtime reads the setting once, when it loads, so `kvledger.cli.main` sets it before anything
imports torch; a program that is not kvledger's (vLLM, its clients) gets the user's environment
(`peer_environment`).

One thread computes. torch's OpenMP runtime keeps a team of worker threads per thread that has computed,
for as long as that thread lives. The server loads the model in its main thread and then steps it in
another (async_engine.py), so without `release_team` the main thread's idle team stays. GNU OpenMP then
manages more threads than there are CPUs, and it throttles the workers' spinning between parallel regions
to almost nothing: each of a decode step's ~450 regions ends in a futex sleep and a wake-up. Measured on
2 cores, SmolLM2 decoding after 2,304 tokens: 73 ms a step with the main thread's team left, 61 ms with
it released or stepping in the main thread; 29,000 voluntary context switches per 64 steps against 90.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from kvledger.engine.defaults import DEFAULTS

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
# GNU, Intel and LLVM's OpenMP runtimes, as torch's builds ship them ("libgomp-a34b3233.so.1", "libomp.so")
OPENMP_LIB = re.compile(r"(libgomp|libiomp5|libomp)(-[0-9a-f]+)?\.so[.0-9]*")
STREAM_HITS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
OMP_PAUSE_SOFT = 1                                # omp_pause_resource_t: free the threads, keep the settings
SPIN_COUNT = "2000"                               # GNU OpenMP's spins before an idle worker sleeps (`limit_spinning`)
# the user's own choices of how idle workers wait (the standard's, GNU's and Intel's/LLVM's): any one set wins
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_COUNT_MARK = "KVLEDGER_SET_GOMP_SPINCOUNT"     # "1" where kvledger, not the user, set GOMP_SPINCOUNT


def limit_spinning(env: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT=SPIN_COUNT in `env` (this process's environment by default) unless the user set how OpenMP
    waits (`WAIT_SETTINGS`), marked as kvledger's so that `peer_environment` can take it back out. True when the
    setting in force is kvledger's. Only a runtime loaded after this reads it: call it before torch is imported
    (module docstring). Children inherit it, as they should: they are kvledger's engines and fetchers."""
    env = os.environ if env is None else env
    if env.get(SPIN_COUNT_MARK) == "1":
        return True
    if any(env.get(name, "").strip() for name in WAIT_SETTINGS):
        return False
    env["GOMP_SPINCOUNT"], env[SPIN_COUNT_MARK] = SPIN_COUNT, "1"
    return True


def peer_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (this process's by default) as the user gave it, for a program that is not kvledger's
    (vLLM, its benchmark client): without the spin count `limit_spinning` added."""
    out = dict(os.environ if env is None else env)
    if out.pop(SPIN_COUNT_MARK, None) == "1":
        out.pop("GOMP_SPINCOUNT", None)
    return out


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads computing the model (default: $OMP_NUM_THREADS where set, else the CPUs "
                        "this process may run on, less one where two or more remain; on a machine whose other "
                        "processes keep cores busy, give fewer than the cores left free)")


def add_stream_hits_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-hits", choices=STREAM_HITS, default=DEFAULTS.stream_hits,
                   help="whether a hit's forward may start while its blocks arrive (docs/engine.md, \"A streamed "
                        "hit\"); auto: when a CPU is left free of torch threads for the fetcher (default %(default)s)")


def stream_hits(choice: str) -> bool | None:
    """--stream-hits as `Engine(stream_hits=...)` takes it: None for auto (the engine's `streams_by_default`)."""
    return STREAM_HITS[choice]


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


def default_threads(cpus: int) -> int:
    """The threads a process with `cpus` usable CPUs computes on when nothing says otherwise: one CPU left to
    everything else (the server's own threads, other processes) where at least two remain to compute; all of
    them on 1 or 2 CPUs, where leaving one would halve the compute (module docstring)."""
    assert cpus >= 1, cpus
    return cpus - 1 if cpus >= 3 else cpus


def resolve_threads(requested: int | None, *, env: dict[str, str] | None = None,
                    cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The thread count: `requested`, else $OMP_NUM_THREADS, else `default_threads(usable_cpus())`. ValueError
    (one line) for a count below 1 or an OMP_NUM_THREADS that is not one."""
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
    return default_threads(usable_cpus(cpu_max))


def threads_per_process(requested: int | None, processes: int, env: dict[str, str] | None = None,
                        cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Each of `processes` co-located engines' thread count (`kvledger up`): `requested` or $OMP_NUM_THREADS as
    `resolve_threads` reads them, else `default_threads` of the usable CPUs shared out, at least 1 each."""
    assert processes >= 1, processes
    if requested is not None or (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip():
        return resolve_threads(requested, env=env, cpu_max=cpu_max)
    return max(default_threads(usable_cpus(cpu_max)) // processes, 1)


def colocated_stream_hits(choice: str, threads: int, processes: int, cpu_max: Path = CGROUP_CPU_MAX) -> str:
    """--stream-hits for each of `processes` co-located engines computing on `threads` each (`kvledger up`): "auto"
    decided for all of them, since each engine alone would count only its own threads; on or off as given."""
    assert threads >= 1 and processes >= 1, (threads, processes)
    if choice != "auto":
        return choice
    return "on" if threads * processes < usable_cpus(cpu_max) else "off"


def set_threads(n: int) -> int:
    """Compute with `n` torch threads from now on, in every thread of this process; the count torch took."""
    import torch

    assert n >= 1, n
    torch.set_num_threads(n)
    return torch.get_num_threads()


def release_team() -> bool:
    """Let the calling thread's OpenMP team go: its idle workers exit, and the runtime stops counting them.
    Call it in the thread that loaded the model, once another thread computes from then on (module
    docstring). If the calling thread computes again, it gets a new team. True when a loaded OpenMP runtime
    released it; False when none is loaded (torch built without OpenMP) or it refused. GNU OpenMP (torch's
    Linux x86-64 wheels) releases only the calling thread's team; LLVM's and Intel's pause every team of the
    process, which is right only while no other thread computes, as at `AsyncEngine.start`."""
    lib = _loaded_openmp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def _loaded_openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime already mapped into this process (torch's own copy, whatever its file is called);
    None if there is none. Opening a loaded library only returns its handle."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:   # not Linux
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)   # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and OPENMP_LIB.fullmatch(Path(fields[5]).name):
            return ctypes.CDLL(fields[5])
    return None
