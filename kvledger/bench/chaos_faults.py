"""The faults of `kvledger bench chaos`, one kind at a time, on a cluster `kvledger up --juicefs` runs.

Each fault is a function `(cluster, rng, hold_s) -> note`: it injects the fault, holds it `hold_s` where the
fault has a length (a stopped process, a full volume), ends what a person would have to end (SIGCONT, the
filler removed, the folder made writable again) and returns a line saying what it did. What it does not end
is for the cluster to repair by itself: a killed engine, Redis or JuiceFS client is `up`'s to start again,
damaged segments are the store's to find and drop (DESIGN rule 8).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.juicefs import abort_connection

BUSY_WAIT_S = 5.0      # how long a "mid-prefill" / "mid-stream" fault waits for its engine to be busy
FILL_CHUNK = 4 << 20   # bytes of one write of the filler

Fault = Callable[[ClusterProcess, random.Random, float], str]


def engines(cluster: ClusterProcess, role: str) -> list[str]:
    return sorted(n for n in cluster.members if n.startswith(f"{role}-"))


def busy_engine(cluster: ClusterProcess, names: list[str], rng: random.Random) -> tuple[str, bool]:
    """One of `names` running a request now (asked through its internal API, within BUSY_WAIT_S), else any;
    (name, whether it was busy)."""
    deadline = time.monotonic() + BUSY_WAIT_S
    while time.monotonic() < deadline:
        for name in rng.sample(names, len(names)):
            with contextlib.suppress(Exception):   # an engine that does not answer is not the one to pick
                status, health = cluster.engine_get(name, "/engine/v1/health")
                if status == 200 and health.get("running", 0) > 0:
                    return name, True
        time.sleep(0.05)
    return rng.choice(names), False


def kill_prefill(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    name, busy = busy_engine(cluster, engines(cluster, "prefill"), rng)
    cluster.signal(name, signal.SIGKILL)
    return f"SIGKILL {name} ({'mid-request' if busy else 'idle'})"


def kill_decode(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    name, busy = busy_engine(cluster, engines(cluster, "decode"), rng)
    cluster.signal(name, signal.SIGKILL)
    return f"SIGKILL {name} ({'mid-stream' if busy else 'idle'})"


def stop_engine(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    name, busy = busy_engine(cluster, engines(cluster, "prefill") + engines(cluster, "decode"), rng)
    pid = cluster.members[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(hold_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"SIGSTOP {name} ({'mid-request' if busy else 'idle'}) for {hold_s:.0f} s, then SIGCONT"


def kill_redis(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    cluster.signal("redis", signal.SIGKILL)
    return "SIGKILL redis (up restarts it on its port, from its last save)"


def stop_redis(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    pid = cluster.members["redis"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(hold_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"SIGSTOP redis for {hold_s:.0f} s, then SIGCONT"


def mounts(cluster: ClusterProcess) -> list[str]:
    """The JuiceFS clients' names, juicefs-m0.. (not juicefs-meta, its metadata server)."""
    return sorted(n for n in cluster.members if re.fullmatch(r"juicefs-m\d+", n))


def kill_mount(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    name = rng.choice(mounts(cluster))
    path = cluster.members[name].url
    assert path is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(cluster.members[name].pid, signal.SIGKILL)   # `juicefs mount` serves from a child it forks
    abort_connection(Path(path))   # as the kernel does once a dead client's /dev/fuse closes (util/juicefs.py)
    return f"SIGKILL the JuiceFS client {name} (its mount stays, dead: ENOTCONN; up mounts it again)"


def segment_dir(cluster: ClusterProcess) -> Path:
    path = cluster.members[mounts(cluster)[0]].url
    assert path is not None
    return Path(path) / "blocks" / "segments"


def damage_segments(cluster: ClusterProcess, rng: random.Random, hold_s: float, n: int = 6) -> str:
    """`n` random segment files, each corrupted (bytes flipped past its header), truncated to half, or deleted."""
    folder = segment_dir(cluster)
    names = sorted(p for p in folder.iterdir() if p.name.endswith(".kvs"))
    done: dict[str, int] = {"corrupt": 0, "truncate": 0, "delete": 0}
    for path in rng.sample(names, min(n, len(names))):
        how = rng.choice(sorted(done))
        with contextlib.suppress(OSError):   # GC may have removed it meanwhile
            size = path.stat().st_size
            if how == "corrupt":
                with open(path, "r+b") as f:
                    for _ in range(8):
                        f.seek(rng.randrange(min(4096, size - 1), size))
                        f.write(bytes([rng.randrange(256)]))
            elif how == "truncate":
                os.truncate(path, size // 2)
            else:
                path.unlink()
            done[how] += 1
    return f"of {len(names)} segments: " + ", ".join(f"{k} {v}" for k, v in done.items())


def fill_volume(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    """A filler file up to the volume's quota (`up --juicefs-capacity`), held `hold_s`, then removed."""
    filler = segment_dir(cluster).parent.parent / f"filler-{os.getpid()}"
    written, chunk = 0, os.urandom(FILL_CHUNK)
    try:
        with open(filler, "wb") as f:
            while written < 64 << 30:
                f.write(chunk)
                written += FILL_CHUNK
    except OSError as e:
        note = f"filled after {written >> 20} MiB ({e.strerror})"
    else:
        note = f"wrote {written >> 20} MiB without filling it (no quota?)"
    try:
        time.sleep(hold_s)
    finally:
        with contextlib.suppress(OSError):
            filler.unlink()
    return note + f"; held {hold_s:.0f} s, then removed"


def readonly_dir(cluster: ClusterProcess, rng: random.Random, hold_s: float) -> str:
    """One mount's segment folder made read-only (a read-only bind mount over it) for `hold_s`: the engines
    on that mount cannot write there, and read as before."""
    name = rng.choice(mounts(cluster))
    path = cluster.members[name].url
    assert path is not None
    folder = str(Path(path) / "blocks" / "segments")
    subprocess.run(["mount", "--bind", folder, folder], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", folder], check=True, capture_output=True, timeout=30)
        time.sleep(hold_s)
    finally:
        subprocess.run(["umount", folder], capture_output=True, timeout=30)
    return f"{name}'s segment folder read-only for {hold_s:.0f} s"


FAULTS: dict[str, tuple[Fault, float, str]] = {   # kind → (fault, hold in s, what it is)
    "kill_prefill": (kill_prefill, 0.0, "SIGKILL a prefill engine mid-prefill"),
    "kill_decode": (kill_decode, 0.0, "SIGKILL the decode engine mid-stream"),
    "stop_engine": (stop_engine, 10.0, "SIGSTOP an engine for 10 s, then SIGCONT"),
    "kill_redis": (kill_redis, 0.0, "SIGKILL Redis; up restarts it on the same port"),
    "stop_redis": (stop_redis, 5.0, "SIGSTOP Redis for 5 s"),
    "kill_mount": (kill_mount, 0.0, "SIGKILL one JuiceFS client while its engines use it"),
    "damage_segments": (damage_segments, 0.0, "corrupt, truncate or delete random segment files on the volume"),
    "fill_volume": (fill_volume, 8.0, "fill the volume to its quota for 8 s"),
    "readonly_dir": (readonly_dir, 8.0, "make one mount's segment folder read-only for 8 s"),
}
