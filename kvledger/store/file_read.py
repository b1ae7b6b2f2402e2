"""Reads of the embedded store: blocks that lie back to back in a segment are read with one
`preadv` (through the directory's fd cache, segment_files.py) straight into the caller's
buffers, and each is checked against its xxh3-64. A short read (a segment cut or removed
under us) or a mismatch is a miss, counted, and the entry is dropped from the index (its segment
noted in `damaged`, for the store to flag the entry dead on disk at once: a process that opens the
store later must not find the bad copy again, rule 8). A read
that fails with an error (EIO, ENOTCONN, ESTALE) is `UNREADABLE`: counted, the entry kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import xxhash

from kvledger.store.backend import MISS, UNREADABLE, Buffer, Counters
from kvledger.store.index import Entry, MemoryIndex, Segment, runs
from kvledger.store.segment_files import SegmentFiles, read_views

log = logging.getLogger("kvledger.store")


class BlockReader:
    """Reads blocks the index knows into caller buffers. The caller holds the store's lock."""

    def __init__(self, files: SegmentFiles, index: MemoryIndex, counters: Counters) -> None:
        self.files = files
        self.index = index
        self.counters = counters
        self.damaged: set[Segment] = set()   # segments with entries dropped for proven damage, not yet on disk

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Buffer], now: float) -> list[int]:
        """Per key its size, MISS (absent, expired at `now`, truncated, corrupt) or UNREADABLE (a read error)."""
        out = [MISS] * len(keys)
        hits = []
        for i, k in enumerate(keys):
            e = self.index.live(k, now)
            if e is None:
                self.counters.misses_absent += 1
            else:
                hits.append((i, e))
        for run in runs(hits):
            self.read_run(run, bufs, out)
        return out

    def read_run(self, run: list[tuple[int, Entry]], bufs: Sequence[Buffer], out: list[int],
                 drop: bool = True) -> None:
        """Read blocks that lie back to back in one segment (index.runs) and check each;
        `out[i]` = its size, or stays MISS (dropped from the index when `drop`), or UNREADABLE on a read error."""
        seg = run[0][1].seg
        views = read_views(run, bufs)
        start = run[0][1].offset
        try:
            got = self.files.read_into(seg.name, views, start)
        except OSError as err:   # EIO, ENOTCONN, ESTALE, ...: not proof of damage; the entries stay
            log.warning("read of segment %s failed: %s", seg.name, err)
            for i, _ in run:
                out[i] = UNREADABLE
            self.counters.misses_unreadable += len(run)
            return
        for (i, e), v in zip(run, views):
            if e.offset + e.size - start > got:
                self.counters.misses_truncated += 1
            elif xxhash.xxh3_64_intdigest(v) != e.xxh:
                self.counters.misses_corrupt += 1
                log.warning("block %s of segment %s fails its checksum", e.key.hex(), seg.name)
            else:
                out[i] = e.size
                self.counters.blocks_read += 1
                self.counters.bytes_read += e.size
                continue
            if drop:
                self.index.remove(e)
                self.damaged.add(e.seg)
