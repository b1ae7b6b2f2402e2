"""GC, eviction and write-back of the embedded store: what changes segment files after they are written.

Every method here runs with the store's lock and the directory's flock held, so no other
process writes the same mutable arrays meanwhile. Before a segment's arrays are written they
are merged with what is on disk: another process may have refreshed a block (the later
expiry wins) or removed one (a block flagged dead stays dead). GC merges every segment first,
so a hit that another process made durable keeps its blocks.

Space comes back tails first (gc.py): a segment is cut after its last live block, or unlinked
once it holds none.
"""

from __future__ import annotations

import math

from kvledger.store import gc as gc_plan
from kvledger.store import segment as sg
from kvledger.store.backend import Counters
from kvledger.store.file_index import IndexUpkeep
from kvledger.store.index import MemoryIndex, Segment
from kvledger.store.segment_files import SegmentFiles

MUTABLE_BYTES = 17  # per entry: expiry f64, last hit f64, flag u8 (segment.py)


class Collector:
    """Removes blocks from segment files: expired ones, least recently hit ones, deleted ones."""

    def __init__(self, files: SegmentFiles, index: MemoryIndex, upkeep: IndexUpkeep, counters: Counters) -> None:
        self.files = files
        self.index = index
        self.upkeep = upkeep
        self.counters = counters

    def expire(self, now: float, batch: int) -> tuple[int, int]:
        """Remove blocks whose effective expiry has passed, tails first, `batch` at a time;
        (blocks removed, counting those already expired at open; batches)."""
        for seg in list(self.index.segments):  # other processes' refreshes and removals count
            self.merge(seg)
        due = gc_plan.expired_tails_first(self.index.values(), now)
        at_open = sum(s.expired_at_open for s in self.index.segments)
        n_batches = 0
        for chunk in gc_plan.batches(due, batch):
            for e in chunk:
                self.index.remove(e)
            self.reclaim({e.seg for e in chunk})
            n_batches += 1
        self.reclaim({s for s in self.index.segments if s.trim})
        for seg in self.index.segments:
            seg.expired_at_open = 0
        self.counters.gc_expired += len(due) + at_open
        return len(due) + at_open, n_batches

    def evict(self, need_bytes: int) -> int:
        """Remove the least recently hit blocks, tails first, until `need_bytes` are freed."""
        victims = gc_plan.lru_tails_first(self.index.values(), need_bytes)
        for e in victims:
            self.index.remove(e)
        self.reclaim({e.seg for e in victims})
        self.counters.gc_evicted += len(victims)
        return len(victims)

    def reclaim(self, segs: set[Segment]) -> None:
        """Persist dead flags, then cut each segment after its last live block (or unlink it)."""
        for seg in segs:
            if self.index.segment(seg.name) is not seg:
                continue
            self.merge(seg)
            if self.index.segment(seg.name) is not seg:
                continue
            last = max((e.idx for e in seg.live()), default=None)
            if last is None:
                self.files.unlink(seg.name)
                self.index.forget_segment(seg)
                continue
            self.write_back(seg)
            e = seg.entries[last]
            end = e.offset + e.size
            if end < seg.file_size:
                self.files.cut(seg.name, end)
                seg.file_size = end
            seg.trim = False

    def flush(self) -> None:
        """Write refreshed expiries and last hits back to their segments."""
        for seg in list(self.index.segments):
            if seg.dirty:
                self.write_back(seg)

    def merge(self, seg: Segment) -> None:
        """Take in what other processes wrote to `seg`'s mutable arrays: a later expiry or last hit
        wins, a block flagged dead is dropped. A segment that vanished is forgotten."""
        n = len(seg.entries)
        raw = self.files.read_mutable(seg.name, seg.mutable_off, MUTABLE_BYTES * n)
        if raw is None:
            self.upkeep.forget(seg)
            return
        if len(raw) < MUTABLE_BYTES * n:
            return
        exp = memoryview(raw)[:8 * n].cast("d")
        hit = memoryview(raw)[8 * n:16 * n].cast("d")
        for i, e in enumerate(seg.entries):
            if e is None:
                continue
            if raw[16 * n + i] != sg.FLAG_LIVE:
                self.index.remove(e)
                continue
            if math.isfinite(exp[i]) and exp[i] > e.expiry:
                e.expiry = exp[i]
            if math.isfinite(hit[i]) and e.last_hit < hit[i] <= e.expiry:
                e.last_hit = hit[i]

    def write_back(self, seg: Segment) -> None:
        """Write `seg`'s expiries, last hits and flags, merged first with what is on disk."""
        seg.dirty = False  # before reading the values: a hit racing this write marks it dirty again
        self.merge(seg)
        if self.index.segment(seg.name) is not seg:
            return
        n = len(seg.entries)
        buf = bytearray(MUTABLE_BYTES * n)
        exp = memoryview(buf)[:8 * n].cast("d")
        hit = memoryview(buf)[8 * n:16 * n].cast("d")
        for i, e in enumerate(seg.entries):
            if e is None:
                exp[i], hit[i] = seg.created + seg.ttl_s, seg.created
                buf[16 * n + i] = sg.FLAG_DEAD
            else:
                exp[i], hit[i] = e.expiry, e.last_hit
        try:
            self.files.write_mutable(seg.name, seg.mutable_off, buf)
        except FileNotFoundError:
            self.upkeep.forget(seg)
