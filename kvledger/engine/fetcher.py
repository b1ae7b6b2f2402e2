"""The fetcher: a process of its own that reads hit blocks from the block ledger into host shared memory (rule 6).

The engine owns a staging area (one shared-memory segment of `capacity` blocks) and a socketpair
to the fetcher process (`python -m kvledger.engine.fetcher`, a fresh interpreter: nothing of the
engine is inherited or pickled). Messages are struct frames, little-endian:

    request   | magic "KVF2" | job u32 | n u32 | staging offset u64 (bytes) | block_bytes u32 | n × 16-byte key |
    response  | magic "KVF2" | job u32 | intact i32 (leading blocks read and verified; -1: error) | ns u64 |
              | bytes_read u64 | absent u32 | corrupt u32 |

The fetcher's first frame is a response with magic "KVFR" (job 0; ns: how long mapping the staging area and
opening its store took): the store is open. A job's deadline (`timeout_s` + 50 ms per block) counts from its
submission or from that frame, whichever is later: a store still opening (a fresh fetcher, a restarted one)
costs no job its time.
Until the frame, a job's deadline is `open_timeout_s` after the process started plus its own budget, so a
fetcher that hangs while opening is killed too.

The fetcher writes block i of a job at offset + i · block_bytes and answers once the whole job is
read: `intact` leading blocks arrived with their checksums verified (the ledger checks them).
`bytes_read` are the bytes of every block that arrived intact (what the store really delivered);
`absent` and `corrupt` count the job's misses by cause as the fetcher's store saw them (corrupt:
a checksum mismatch or a short read), since the server cannot see this process's counters. A
fetcher that dies, hangs past the job's deadline or answers garbage is killed and restarted; its
jobs read as 0 intact blocks, so their requests recompute (rule 8). It never outlives the engine: it
ends at EOF on its socket, and gets SIGTERM when the engine thread that started it ends (the loading
thread, or the step thread for a restart; `serve_process.spawn`).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from kvledger.core import KEY_BYTES
from kvledger.store.open import DEFAULT_PREFIX, StoreLocation, location_of, open_block_store
from kvledger.util.redis_client import REDIS_URL_ENV
from kvledger.util.serve_process import spawn

MAGIC = b"KVF2"
READY = b"KVFR"   # the magic of the fetcher's first frame: its store is open
OPEN_TIMEOUT_S = 30.0   # a fetcher whose store is not open this long after its start is killed (its jobs: 0)
REQUEST = struct.Struct("<4sIIQI")
RESPONSE = struct.Struct("<4sIiQQII")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("peer closed")
        buf += part
    return bytes(buf)


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


def _map_pages(shm: shared_memory.SharedMemory) -> None:
    """Map every page of the staging area into this process now, by reading one byte of each: the engine
    faulted them in when it made the area, but each process maps them on its own, and 94 MB of pages mapped by
    a hit's reads cost it 30 ms (a 4,096-token SmolLM2 hit: a fetch of 39 ms against 9 once mapped). Reads,
    never writes: a restarted fetcher attaches while the engine may still be copying a finished job out."""
    pages = np.frombuffer(shm.buf, dtype=np.uint8)[::mmap.PAGESIZE]
    int(pages.max(initial=0))
    del pages


def serve(sock: socket.socket, shm_name: str, path: str | None, redis_url: str | None,
          prefix: str = DEFAULT_PREFIX) -> None:
    """Answer jobs until the engine closes its end."""
    shm = shared_memory.SharedMemory(name=shm_name)
    with contextlib.suppress(Exception):  # attached, not owned: the engine unlinks it
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    t0 = time.perf_counter_ns()
    _map_pages(shm)
    store = _open_store(path, redis_url, prefix)
    sock.sendall(RESPONSE.pack(READY, 0, 0, time.perf_counter_ns() - t0, 0, 0, 0))
    view = memoryview(shm.buf)
    try:
        while True:
            try:
                magic, job, n, offset, block_bytes = REQUEST.unpack(_recv_exact(sock, REQUEST.size))
                keys_raw = _recv_exact(sock, n * KEY_BYTES)
            except EOFError:
                return
            assert magic == MAGIC, "not a fetch request"
            t0 = time.perf_counter_ns()
            intact, got, misses = -1, 0, (0, 0)
            if offset + n * block_bytes <= len(view):
                keys = [keys_raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
                bufs = [view[offset + i * block_bytes: offset + (i + 1) * block_bytes] for i in range(n)]
                before = miss_counts(store)
                sizes = store.get_into(keys, bufs)
                misses = tuple(b - a for a, b in zip(before, miss_counts(store)))
                intact = next((i for i, s in enumerate(sizes) if s != block_bytes), n)
                got = sum(s for s in sizes if s == block_bytes)
                del bufs
            sock.sendall(RESPONSE.pack(MAGIC, job, intact, time.perf_counter_ns() - t0, got, *misses))
    finally:
        view.release()
        store.close()
        shm.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="kvledger fetcher process (started by the engine)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--path")
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV))
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="the Redis key prefix of the store")
    a = p.parse_args(argv)
    # the engine owns this process's lifetime: a terminal's Ctrl-C reaches the whole process group, and
    # this process ends when the engine's socket closes (EOF), not with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(socket.socket(fileno=a.fd), a.shm, a.path, a.redis_url, a.prefix)


# --- the engine's side ---------------------------------------------------------------------


@dataclass(slots=True)
class FetchJob:
    job: int
    offset: int           # bytes into the staging area
    n: int                # blocks
    deadline: float       # perf_counter seconds (see the module docstring: counted from the store being open)
    started: float        # perf_counter seconds at submission
    budget_s: float       # seconds the fetcher has for it once its store is open
    intact: int | None = None   # set when done: leading blocks intact (0 on any failure)
    fetch_s: float = 0.0
    bytes_read: int = 0         # bytes of the blocks that arrived intact (0 when the fetcher failed)
    misses: dict[str, int] = field(default_factory=dict)   # cause ("absent", "corrupt") → blocks

    @property
    def done(self) -> bool:
        return self.intact is not None


def ledger_location(ledger: object) -> StoreLocation:
    """The location that opens the ledger's store in another process."""
    return location_of(ledger.store)  # type: ignore[attr-defined]


class Fetcher:
    """Engine side: the staging area, the process, the jobs in flight (single-threaded use)."""

    def __init__(self, ledger: object, block_bytes: int, capacity_blocks: int, *, timeout_s: float = 10.0,
                 open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        assert block_bytes > 0 and capacity_blocks > 0
        self.block_bytes, self.capacity, self.timeout_s = block_bytes, capacity_blocks, timeout_s
        self.open_timeout_s = open_timeout_s   # a fetcher whose store is not open by then is killed
        self.spawned = 0.0                     # perf_counter seconds when the process was started
        self.ready_at: float | None = None     # perf_counter seconds when its READY frame arrived
        self.location = ledger_location(ledger)
        self.shm = shared_memory.SharedMemory(create=True, size=block_bytes * capacity_blocks)
        self.staging = np.ndarray((capacity_blocks, block_bytes), dtype=np.uint8, buffer=self.shm.buf)
        self.staging.fill(0)  # fault the pages in once, not on the first hit
        self.jobs: dict[int, FetchJob] = {}
        self.used: dict[int, tuple[int, int]] = {}  # job → (first staging block, n)
        self.restarts = 0
        self._next = 1
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "kvledger.engine.fetcher", "--fd", str(theirs.fileno()), "--shm", self.shm.name]
        where = self.location
        cmd += ["--path", where.path] if where.path else []
        cmd += ["--prefix", where.prefix] if where.prefix != DEFAULT_PREFIX else []
        env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}   # the URL may carry a password:
        env |= {REDIS_URL_ENV: where.redis_url} if where.redis_url else {}  # not on the command line
        self.spawned, self.ready_at = time.perf_counter(), None
        self.proc = spawn(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)   # dies with us
        theirs.close()
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

    def _alloc(self, n: int) -> int | None:
        """First fit: the first staging block of a free run of n, or None."""
        start = 0
        for first, count in sorted(self.used.values()):
            if first - start >= n:
                return start
            start = max(start, first + count)
        return start if self.capacity - start >= n else None

    def submit(self, keys: list[bytes]) -> FetchJob | None:
        """Start reading `keys`' blocks; None when the staging area has no room now (try later)."""
        assert 0 < len(keys) <= self.capacity, "a job larger than the staging area"
        first = self._alloc(len(keys))
        if first is None:
            return None
        now = time.perf_counter()
        job = FetchJob(self._next, first * self.block_bytes, len(keys), 0.0, now, self.timeout_s + 0.05 * len(keys))
        job.deadline = self._deadline(job)
        self._next = self._next % 0xFFFFFFFF + 1
        self.jobs[job.job] = job
        self.used[job.job] = (first, len(keys))
        try:
            assert self.sock is not None
            self.sock.sendall(REQUEST.pack(MAGIC, job.job, job.n, job.offset, self.block_bytes) + b"".join(keys))
        except OSError:
            self._restart()
        return job

    def view(self, job: FetchJob) -> np.ndarray:
        """The job's blocks in the staging area: uint8 [n, block_bytes] (valid until `release`)."""
        first = job.offset // self.block_bytes
        return self.staging[first:first + job.n]

    def release(self, job: FetchJob) -> None:
        self.used.pop(job.job, None)
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
        del self.staging
        self.shm.close()
        self.unlink_staging()

    def unlink_staging(self) -> None:
        """Unlink the staging area's name (the mapping stays valid for whoever still uses it)."""
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()


if __name__ == "__main__":
    main()
