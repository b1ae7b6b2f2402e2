"""A bound on what the index's memory map adds to a process's resident memory (RSS).

LMDB reads through a read-only shared mapping of `data.mdb`. Each first touch of a page faults it
in, and Linux maps with it up to 15 neighbouring pages already in the page cache (fault-around,
64 KiB; MADV_RANDOM does not turn it off), so a process that looks up random keys of a large
index gains ~64 KiB of RSS per key until the whole file is mapped: measured at 10M blocks (a
1.6 GB index), 200 puts of 64 blocks left ~0.8 GB of it resident in the putting process. Those
pages are the page cache, shared by every process and reclaimable, not the process's own memory,
but RSS counts them.

`MapTrim` drops them from this process's page tables after about `every` key lookups: madvise
MADV_DONTNEED on a read-only shared file mapping unmaps the pages and keeps their contents in
the page cache (no I/O; the next touch is a minor fault). So the map adds at most about
`every` × 64 KiB to RSS, whatever the index's size; the price is those minor faults again after
each trim (a few µs per key looked up). Linux only; elsewhere (or when the mapping is not found) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

from kvledger.util.libc import MADV_DONTNEED, libc

log = logging.getLogger("kvledger.store")

TRIM_EVERY = 4096      # key lookups between trims: ~200 MiB mapped at most (measured: ~48 KiB per key a put
#                        looks up, the pages its commit wrote elsewhere, copy-on-write, included)


def find_mapping(path: str) -> tuple[int, int] | None:
    """(start, end) of this process's read-only shared mapping of `path` (matched by inode), or None."""
    try:
        st = os.stat(path)
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[1] != "r--s" or int(parts[4]) != st.st_ino:
            continue
        if os.path.realpath(parts[5].strip()) != os.path.realpath(path):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        return start, end
    return None


class MapTrim:
    """Trims one mapping every `every` lookups, in a short-lived thread (madvise takes a few milliseconds
    with many pages mapped; ctypes releases the GIL). Made right after the environment opens and closed
    before it closes: an address kept past that could name other memory, hence the lock."""

    def __init__(self, data_path: str, every: int = TRIM_EVERY) -> None:
        assert every > 0
        self.every = every
        self.background = True          # False: trim in the caller's thread (tests: a deterministic bound)
        self.trims = 0
        self._count = 0
        self._busy = False
        self._lock = threading.Lock()   # a trim and `close` exclude each other
        self._range = find_mapping(data_path) if sys.platform.startswith("linux") else None
        if self._range is None:
            log.debug("no mapping of %s found: RSS is not trimmed", data_path)

    def touched(self, n: int) -> None:
        """Note `n` key lookups; trim when `every` have accumulated (counts are approximate across threads)."""
        self._count += n
        if self._count >= self.every and not self._busy and self._range is not None:
            self._count = 0
            if not self.background:
                self.trim()
                return
            self._busy = True
            threading.Thread(target=self._trim_then_idle, name="kvledger-map-trim", daemon=True).start()

    def _trim_then_idle(self) -> None:
        try:
            self.trim()
        finally:
            self._busy = False

    def trim(self) -> None:
        with self._lock:
            if self._range is None:
                return
            start, end = self._range
            rc = libc().madvise(start, end - start, MADV_DONTNEED)
            if rc != 0:
                log.warning("madvise of the index map failed (errno %d): RSS not trimmed", ctypes.get_errno())
                self._range = None
                return
            self.trims += 1

    def close(self) -> None:
        """Before the environment closes: no trim after this returns."""
        with self._lock:
            self._range = None
