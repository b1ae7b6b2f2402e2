"""Keeps the LMDB index in memory (`IndexPin`), so that no CHECK or put waits on an index page read from disk.

Why it is needed: a process maps the index only while a lookup runs (the warm path reads with read(), and
MapTrim unmaps each process's pages every few thousand lookups), so between lookups the index is page cache
that no process maps: the first pages any reclaim takes, under memory pressure or by a proactive reclaimer
(this machine's DAMON scheme pages out unmapped file pages idle for a minute; docs/store.md, "Why a cached
index page is read again"). A put that reaches a page taken that way reads it from disk behind whatever else
is writing: the 10M bench's slowest puts during GC.

`IndexPin` maps the file read-only and locks the mapping (mlock(2)): each page is read in once, then stays
resident until the pin closes, whatever reclaims. The file only grows (LMDB reuses freed pages and never
truncates it), so every `every_s` the pin extends itself over the new tail; pages written in between are
fresh in the page cache. Locking takes RLIMIT_MEMLOCK ≥ the file's size, or CAP_IPC_LOCK, and a locked page
is not reclaimed even when the node runs short, so the pin locks at most `lock_budget` bytes (default a
quarter of the machine's memory: a 100M-block index of 15 GB is not locked on a 32 GB node). Beyond the
budget, or where mlock is refused, the pin keeps the pages mapped and populated instead (mode "mapped": out
of reach of a reclaimer of unmapped pages, not of memory pressure) and logs that once. The cost is the
index's size in memory (2.6 GB for the bench's 10M-block store), counted in this process's RSS as shared
file pages. Linux only; elsewhere the mode is "off".

One pin per node is enough (the pages are shared): the embedded server's process holds it, not its fetcher.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field

from kvledger.util.libc import MADV_POPULATE_READ, MAP_FAILED, libc

log = logging.getLogger("kvledger.store")

CHUNK = 64 << 20                 # bytes locked per mlock call: the mapping's lock is not held long at once
EVERY_S = 5.0                    # seconds between looks at the file's size
LOCK_SHARE = 0.25                # default lock budget: this share of the machine's physical memory


def default_lock_budget() -> int:
    """LOCK_SHARE of physical memory, bytes."""
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * LOCK_SHARE)


def cached_share(path: str | os.PathLike) -> float | None:
    """Share of the file's pages in the page cache now (mincore(2)); None where that cannot be asked."""
    size = os.path.getsize(path)
    if size == 0 or not sys.platform.startswith("linux"):
        return None
    lib = libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, MAP_FAILED):
        return None
    try:
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        if lib.mincore(addr, size, vec) != 0:
            return None
        return bytes(vec).translate(_LOW_BIT).count(1) / len(vec)   # bit 0: cached; the others are reserved
    finally:
        lib.munmap(addr, size)


_LOW_BIT = bytes(b & 1 for b in range(256))


@dataclass(slots=True)
class IndexPin:
    """Pins `path` (the index's data.mdb) in memory from `start()` to `close()`; see the module docstring.

    Invariant: the file's bytes [0, pinned_bytes) are mapped by `_regions` (page-aligned, in order, no gaps), and
    the first `locked_bytes` of them locked (≤ lock_budget); `mode` is "locked" while every pinned byte is."""

    path: str
    lock: bool = True                  # False: map and populate only (mode "mapped")
    lock_budget: int = field(default_factory=default_lock_budget)   # bytes locked at most
    every_s: float = EVERY_S
    mode: str = "off"                  # "locked" | "mapped" | "off" (not started, closed, or not Linux)
    pinned_bytes: int = 0
    locked_bytes: int = 0
    _regions: list[tuple[int, int]] = field(default_factory=list)   # (address, bytes)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _mutex: threading.Lock = field(default_factory=threading.Lock)  # extend and close exclude each other
    _thread: threading.Thread | None = None
    _libc: ctypes.CDLL | None = None

    def start(self) -> IndexPin:
        """Pin in a background thread (the first pin reads whatever of the file is not cached); `wait` for it."""
        assert self._thread is None, "started twice"
        if not sys.platform.startswith("linux"):
            self._ready.set()
            return self
        self._libc = libc()
        self.mode = "locked" if self.lock else "mapped"
        self._thread = threading.Thread(target=self._run, name="kvledger-index-pin", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the file as it was at `start` is pinned."""
        return self._ready.wait(timeout_s)

    def _run(self) -> None:
        failing = False   # warned of the current run of failed looks: once, not every `every_s`
        try:
            while True:
                try:
                    self.extend()
                    failing = False
                except OSError as e:   # the file gone or unreadable: nothing to keep; a later look may find it
                    if not failing:
                        log.warning("index pin of %s: %s", self.path, e)
                    failing = True
                self._ready.set()
                if self._stop.wait(self.every_s):
                    return
        finally:
            self._ready.set()

    def extend(self) -> int:
        """Pin the file's tail beyond `pinned_bytes`; returns the bytes added."""
        with self._mutex:
            if self._stop.is_set() or self._libc is None:
                return 0
            size = os.path.getsize(self.path) // mmap.PAGESIZE * mmap.PAGESIZE
            n = size - self.pinned_bytes
            if n <= 0:
                return 0
            fd = os.open(self.path, os.O_RDONLY)
            try:
                addr = self._libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, self.pinned_bytes)
            finally:
                os.close(fd)
            if addr in (None, MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}")
            self._regions.append((addr, n))
            self.pinned_bytes = size
            self._hold(addr, n)
            return n

    def _hold(self, addr: int, n: int) -> None:
        lib = self._libc
        assert lib is not None
        for off in range(0, n, CHUNK):
            if self._stop.is_set():   # closing: its regions are unmapped next
                return
            step = min(CHUNK, n - off)
            if self.mode == "locked":
                if self.locked_bytes + step > self.lock_budget:
                    log.warning("index pin of %s: over its lock budget of %d MiB: the rest is kept mapped, not "
                                "locked", self.path, self.lock_budget >> 20)
                    self.mode = "mapped"
                elif lib.mlock(addr + off, step) == 0:
                    self.locked_bytes += step
                    continue
                else:
                    log.warning("index pin of %s: mlock refused (%s; RLIMIT_MEMLOCK or CAP_IPC_LOCK): its pages are "
                                "kept mapped, not locked", self.path, os.strerror(ctypes.get_errno()))
                    self.mode = "mapped"
            if lib.madvise(addr + off, step, MADV_POPULATE_READ) != 0 and ctypes.get_errno() == errno.EINVAL:
                self._touch(addr + off, step)   # a kernel older than 5.14: read one byte of each page

    @staticmethod
    def _touch(addr: int, n: int) -> None:
        for p in range(addr, addr + n, mmap.PAGESIZE):
            ctypes.c_char.from_address(p).value   # noqa: B018 - the read faults the page in

    def close(self) -> None:
        """Idempotent: stop extending, then unmap (which unlocks) every region."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            for addr, n in self._regions:
                assert self._libc is not None
                self._libc.munmap(addr, n)
            self._regions.clear()
            self.pinned_bytes = self.locked_bytes = 0
            self.mode = "off"

    def __enter__(self) -> IndexPin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
