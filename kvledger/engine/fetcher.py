"""The fetcher: a process of its own that reads hit blocks from the block ledger into host shared memory (rule 6).

The engine owns a shared area (`SharedArea`: a memfd both processes map) and a socketpair to the fetcher process
(`python -m kvledger.engine.fetcher`, a fresh interpreter: nothing of the engine is inherited or pickled). The area
is laid out in `parts`, (base, bytes) in bytes: row r of part p is [base_p + r · bytes_p, base_p + (r + 1) · bytes_p),
and a ledger block is its parts' bytes one after another. Two layouts use it (`fetch_target`):

    | target        | area                              | parts                       | a job's rows       |
    |---------------|-----------------------------------|-----------------------------|--------------------|
    | the pool (CPU)| the engine's device blocks        | one per layer with block KV | the device blocks  |
    | staging (GPU) | a staging area, swapped in after  | one, the whole block        | staging rows       |

Messages are struct frames, little-endian:

    request   | magic "KVF3" | job u32 | n u32 | flags u32 | n × 16-byte key | n × row u32 |
    response  | magic "KVF3" | job u32 | intact i32 (leading blocks read and verified; -1: error) | ns u64 |
              | bytes_read u64 | absent u32 | corrupt u32 |

The fetcher's first frame is a response with magic "KVFR" (job 0; ns: how long mapping the area and opening its
store took): the store is open. A job's deadline (`timeout_s` + 50 ms per block) counts from its submission or from
that frame, whichever is later: a store still opening (a fresh fetcher, a restarted one) costs no job its time.
Until the frame, a job's deadline is `open_timeout_s` after the process started plus its own budget, so a fetcher
that hangs while opening is killed too.

The fetcher reads block i of a job into row rows[i] of every part (with the request's BY_PART flag part by part:
part 0 of every block, then part 1, ...: `BlockStore.get_into(on_part=...)`), and answers once the whole job is read:
`intact`
leading blocks arrived with their checksums verified (the ledger checks them, over all the parts). `bytes_read` are
the bytes of every block that arrived intact (what the store really delivered); `absent` and `corrupt` count the
job's misses by cause as the fetcher's store saw them (corrupt: a checksum mismatch or a short read), since the
server cannot see this process's counters.

Progress (a streamed hit: the engine's first forward of the hit runs while its blocks arrive, layer by layer; rule 6's
overlap). A second memfd holds two u32 words, (job, parts): the fetcher sets parts to 0, then job to the job it
starts, then parts to k each time parts [0, k) of every block of that job are in (a store that reads file bytes
part by part; one that gets them whole says nothing until the answer). Each is one aligned 4-byte store, and x86-64
keeps stores in order and loads in order (TSO), so an engine that reads job, then parts, then block bytes sees at
least those parts' bytes in place (`parts_done`); a CPU that may reorder them (Arm, POWER) streams no hit
(`STREAMS_HERE`). What arrived in place is not yet known to be intact: only the answer says so, and the engine uses
no result of such a forward before it (`Engine._streamed_intact`).

A fetcher that dies, hangs past the job's deadline or answers garbage is
killed and reaped (`_stop`: once that returns it writes nothing more) and restarted; its jobs read as 0 intact
blocks, so their requests recompute (rule 8), into rows it can no longer touch. It never outlives the engine: it
ends at EOF on its socket, and gets SIGTERM when the engine thread that started it ends (the loading thread, or the
step thread for a restart; `serve_process.spawn`).
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kvledger.core import KEY_BYTES
from kvledger.engine.shared_area import SharedArea, map_area
from kvledger.store.open import DEFAULT_PREFIX, StoreLocation, location_of, open_block_store
from kvledger.util.redis_client import REDIS_URL_ENV
from kvledger.util.serve_process import spawn

MAGIC = b"KVF3"
READY = b"KVFR"   # the magic of the fetcher's first frame: its store is open
OPEN_TIMEOUT_S = 30.0   # a fetcher whose store is not open this long after its start is killed (its jobs: 0)
REQUEST = struct.Struct("<4sIII")
BY_PART = 1             # request flag: read part by part and report progress (a streamed hit)
ROW = struct.Struct("<I")
RESPONSE = struct.Struct("<4sIiQQII")
Parts = list[tuple[int, int]]   # (base, bytes) per part of a block in the shared area (module docstring)
PROGRESS_BYTES = 8      # (job, parts) as two u32 (module docstring's progress)
STREAMS_HERE = platform.machine().lower() in ("x86_64", "amd64")   # TSO: the progress words' order holds
PART_POLL_S = 0.0002    # how often an engine waiting for a part looks at the progress words


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("peer closed")
        buf += part
    return bytes(buf)


def parse_parts(text: str) -> Parts:
    """"base:bytes,base:bytes,..." (the `--parts` argument) → Parts."""
    return [(int(base), int(size)) for base, size in (p.split(":") for p in text.split(","))]


def format_parts(parts: Parts) -> str:
    return ",".join(f"{base}:{size}" for base, size in parts)


def parts_fit(parts: Parts, rows: int, area_bytes: int) -> bool:
    """Whether `rows` rows of every part lie inside an area of `area_bytes`."""
    return all(size > 0 and base >= 0 and base + rows * size <= area_bytes for base, size in parts)


# --- the fetcher process -------------------------------------------------------------------


def _open_store(path: str | None, redis_url: str | None, prefix: str = DEFAULT_PREFIX):  # -> BlockStore
    """The store `location_of(ledger.store)` names, opened as the ledger's own was (`open_block_store`)."""
    return open_block_store(StoreLocation(path, redis_url or None, prefix), fsync=False, create=False)


def miss_counts(store) -> tuple[int, int]:
    """(absent, corrupt) read misses `store` has counted since it was opened, its segment files' too in
    the cluster mode (Redis index, file bytes); corrupt includes short reads."""
    absent = corrupt = 0
    for owner in (store, getattr(store, "files", None)):
        c = getattr(owner, "counters", None)
        if c is not None:
            absent += c.misses_absent
            corrupt += c.misses_corrupt + c.misses_truncated
    return absent, corrupt


def destinations(view: memoryview, parts: Parts, rows: list[int]) -> list[tuple[memoryview, ...]] | None:
    """Each row's parts in the area (a ledger block's destination, `backend.Dest`); None when a row lies outside."""
    if not all(parts_fit(parts, row + 1, len(view)) for row in rows):
        return None
    return [tuple(view[base + row * size: base + (row + 1) * size] for base, size in parts) for row in rows]


def progress_words(buf: object) -> np.ndarray:
    """The (job, parts) words of a progress memfd's mapping (module docstring)."""
    return np.ndarray((2,), dtype=np.uint32, buffer=buf)


def serve(sock: socket.socket, area_fd: int, area_bytes: int, parts: Parts, path: str | None,
          redis_url: str | None, progress_fd: int, prefix: str = DEFAULT_PREFIX) -> None:
    """Answer jobs until the engine closes its end."""
    t0 = time.perf_counter_ns()
    area = map_area(area_fd, area_bytes)
    os.close(area_fd)
    progress_map = map_area(progress_fd, PROGRESS_BYTES)
    os.close(progress_fd)
    progress = progress_words(progress_map)

    def on_part(k: int) -> None:
        progress[1] = k

    store = _open_store(path, redis_url, prefix)
    sock.sendall(RESPONSE.pack(READY, 0, 0, time.perf_counter_ns() - t0, 0, 0, 0))
    view = memoryview(area)
    block_bytes = sum(size for _, size in parts)
    try:
        while True:
            try:
                magic, job, n, flags = REQUEST.unpack(_recv_exact(sock, REQUEST.size))
                keys_raw = _recv_exact(sock, n * KEY_BYTES)
                rows = [r for (r,) in ROW.iter_unpack(_recv_exact(sock, n * ROW.size))]
            except EOFError:
                return
            assert magic == MAGIC, "not a fetch request"
            t0 = time.perf_counter_ns()
            intact, got, misses = -1, 0, (0, 0)
            dests = destinations(view, parts, rows)
            if dests is not None:
                keys = [keys_raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
                before = miss_counts(store)
                progress[1] = 0   # parts first, then the job (module docstring)
                progress[0] = job
                sizes = store.get_into(keys, dests, on_part=on_part if flags & BY_PART else None)
                misses = tuple(b - a for a, b in zip(before, miss_counts(store)))
                intact = next((i for i, s in enumerate(sizes) if s != block_bytes), n)
                got = sum(s for s in sizes if s == block_bytes)
                del dests
            sock.sendall(RESPONSE.pack(MAGIC, job, intact, time.perf_counter_ns() - t0, got, *misses))
    finally:   # (the progress words stay mapped until the process ends, a moment later)
        view.release()
        store.close()
        area.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="kvledger fetcher process (started by the engine)")
    p.add_argument("--fd", type=int, required=True, help="the engine's socket")
    p.add_argument("--area-fd", type=int, required=True, help="the shared area's memfd")
    p.add_argument("--area-bytes", type=int, required=True)
    p.add_argument("--parts", type=parse_parts, required=True, help="base:bytes,... of a block's parts in the area")
    p.add_argument("--progress-fd", type=int, required=True, help="the memfd of the (job, parts) progress words")
    p.add_argument("--path")
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV))
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="the Redis key prefix of the store")
    a = p.parse_args(argv)
    # the engine owns this process's lifetime: a terminal's Ctrl-C reaches the whole process group, and
    # this process ends when the engine's socket closes (EOF), not with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(socket.socket(fileno=a.fd), a.area_fd, a.area_bytes, a.parts, a.path, a.redis_url, a.progress_fd, a.prefix)


# --- the engine's side ---------------------------------------------------------------------


@dataclass(slots=True)
class FetchJob:
    job: int
    rows: list[int]       # where block i goes: row rows[i] of every part (module docstring)
    deadline: float       # perf_counter seconds (see the module docstring: counted from the store being open)
    started: float        # perf_counter seconds at submission
    budget_s: float       # seconds the fetcher has for it once its store is open
    intact: int | None = None   # set when done: leading blocks intact (0 on any failure)
    fetch_s: float = 0.0
    bytes_read: int = 0         # bytes of the blocks that arrived intact (0 when the fetcher failed)
    misses: dict[str, int] = field(default_factory=dict)   # cause ("absent", "corrupt") → blocks

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def done(self) -> bool:
        return self.intact is not None


def ledger_location(ledger: object) -> StoreLocation:
    """The location that opens the ledger's store in another process."""
    return location_of(ledger.store)  # type: ignore[attr-defined]


class Fetcher:
    """Engine side: the process and the jobs in flight (single-threaded use). Where a job's blocks go (`rows` of the
    area's `parts`) is the caller's (`fetch_target`); the area stays the caller's too."""

    def __init__(self, ledger: object, area: SharedArea, parts: Parts, *, timeout_s: float = 10.0,
                 open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        assert parts and parts_fit(parts, 1, area.size), "the parts lie outside the area"
        self.area, self.parts, self.timeout_s = area, parts, timeout_s
        self.block_bytes = sum(size for _, size in parts)
        self.open_timeout_s = open_timeout_s   # a fetcher whose store is not open by then is killed
        self.spawned = 0.0                     # perf_counter seconds when the process was started
        self.ready_at: float | None = None     # perf_counter seconds when its READY frame arrived
        self.location = ledger_location(ledger)
        self.progress_area = SharedArea(PROGRESS_BYTES, "kvledger-fetch-progress")
        self.progress = progress_words(self.progress_area.buf)
        self.jobs: dict[int, FetchJob] = {}
        self.restarts = 0
        self._next = 1
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.progress[:] = 0   # no job of the process before (module docstring's progress)
        cmd = [sys.executable, "-m", "kvledger.engine.fetcher", "--fd", str(theirs.fileno()),
               "--area-fd", str(self.area.fd), "--area-bytes", str(self.area.size), "--parts", format_parts(self.parts),
               "--progress-fd", str(self.progress_area.fd)]
        where = self.location
        cmd += ["--path", where.path] if where.path else []
        cmd += ["--prefix", where.prefix] if where.prefix != DEFAULT_PREFIX else []
        env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}   # the URL may carry a password:
        env |= {REDIS_URL_ENV: where.redis_url} if where.redis_url else {}  # not on the command line
        self.spawned, self.ready_at = time.perf_counter(), None
        fds = (theirs.fileno(), self.area.fd, self.progress_area.fd)
        self.proc = spawn(cmd, pass_fds=fds, stdin=subprocess.DEVNULL, env=env)
        theirs.close()   # (spawn: the process dies with us)
        self.sock = ours

    @property
    def ready(self) -> bool:
        """Whether the process has said that its store is open (read by `poll`)."""
        return self.ready_at is not None

    def _deadline(self, job: FetchJob) -> float:
        if self.ready_at is None:
            return self.spawned + self.open_timeout_s + job.budget_s
        return max(job.started, self.ready_at) + job.budget_s

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def submit(self, keys: list[bytes], rows: list[int], *, by_part: bool = False) -> FetchJob:
        """Start reading `keys`' blocks, block i into row rows[i] of every part; `by_part`: part by part, with
        progress (`parts_done`), for a forward that may start before the job ends."""
        assert 0 < len(keys) == len(rows) and parts_fit(self.parts, max(rows) + 1, self.area.size)
        now = time.perf_counter()
        job = FetchJob(self._next, list(rows), 0.0, now, self.timeout_s + 0.05 * len(keys))
        job.deadline = self._deadline(job)
        self._next = self._next % 0xFFFFFFFF + 1
        self.jobs[job.job] = job
        try:
            assert self.sock is not None
            self.sock.sendall(REQUEST.pack(MAGIC, job.job, job.n, BY_PART if by_part else 0) + b"".join(keys)
                              + b"".join(ROW.pack(r) for r in rows))
        except OSError:
            self._restart()
        return job

    def parts_done(self, job: FetchJob) -> int:
        """How many leading parts of every block of `job` are in place: all once it is done, else what the progress
        words say (module docstring; 0 while another job is being read). In place is not intact: `job.intact`."""
        if job.done:
            return len(self.parts)
        running, parts = int(self.progress[0]), int(self.progress[1])   # the job first, then its parts
        return parts if running == job.job else 0

    def wait_parts(self, job: FetchJob, k: int, timeout_s: float) -> bool:
        """Until `parts_done(job) >= k` (parts [0, k) in place: True), or `timeout_s` passed (False). The job may end
        meanwhile: its answer (it says what is intact), or its deadline (the fetcher restarted: done, 0 intact); all
        its parts count as in place then. Collects answers meanwhile (`poll`)."""
        until = time.perf_counter() + timeout_s
        while self.parts_done(job) < k:
            if time.perf_counter() >= until:
                return False
            self.poll(PART_POLL_S)
        return True

    def wait_done(self, job: FetchJob) -> None:
        """Until `job` ends: its answer, or its deadline (the fetcher restarted)."""
        while not job.done:
            self.poll(max(job.deadline - time.perf_counter(), 0.0) + 0.01)

    def release(self, job: FetchJob) -> None:
        """Forget a job (done, or given up on: its answer, if one comes, is ignored)."""
        self.jobs.pop(job.job, None)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Collect answers (waiting up to `timeout_s` for the first, or with no job pending for the READY frame
        of a fetcher not ready yet); restart on death or deadline."""
        pending = [j for j in self.jobs.values() if not j.done]
        if self.sock is None or (not pending and self.ready):
            return
        deadline = min((j.deadline for j in pending), default=float("inf"))
        wait = min(timeout_s, max(0.0, deadline - time.perf_counter()))
        readable, _, _ = select.select([self.sock], [], [], wait)
        while readable:
            try:
                magic, job_id, intact, ns, got, absent, corrupt = RESPONSE.unpack(
                    _recv_exact(self.sock, RESPONSE.size))
            except (EOFError, OSError, struct.error):
                self._restart()
                return
            if magic == READY and not self.ready:
                self._on_ready()
                readable, _, _ = select.select([self.sock], [], [], 0)
                continue
            job = self.jobs.get(job_id)
            if magic != MAGIC or job is None:
                self._restart()
                return
            job.intact, job.fetch_s = max(intact, 0), time.perf_counter() - job.started
            job.bytes_read, job.misses = got, {k: v for k, v in (("absent", absent), ("corrupt", corrupt)) if v}
            readable, _, _ = select.select([self.sock], [], [], 0)
        if any(not j.done and j.deadline < time.perf_counter() for j in self.jobs.values()):
            self._restart()

    def _on_ready(self) -> None:
        """The store is open: every job waiting so far gets its whole budget from now."""
        self.ready_at = time.perf_counter()
        for job in self.jobs.values():
            if not job.done:
                job.deadline = self._deadline(job)

    def _restart(self) -> None:
        """Kill the process (dead, hung or confused); every job in flight reads as nothing intact."""
        self.restarts += 1
        now = time.perf_counter()
        for job in self.jobs.values():
            if not job.done:
                job.intact, job.fetch_s = 0, now - job.started
        self._stop()
        self._start()

    def _stop(self) -> None:
        """Kill and reap the process: once this returns it writes nothing more into the area. (SIGKILL ends a read
        blocked on NFS or FUSE too: those sleep killably. A process the kernel cannot end in 5 s raises here rather
        than let its rows be reused under it.)"""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def close(self) -> None:
        self._stop()
        self.progress_area.close()


if __name__ == "__main__":
    main()
