"""Index upkeep of the embedded store: the index rebuilt from the segments' metadata at open (no
block byte read), and kept in step with other writers by re-listing the directory when its
mtime changes.

A block is indexed when its flag is live, its bytes lie inside the file (a segment cut short
by GC or by a fault has lost its tail) and it has not expired; an expired one is counted on
its segment so that GC reports it.
"""

from __future__ import annotations

import logging
import math
import time

from kvledger.store import segment as sg
from kvledger.store.index import Entry, MemoryIndex, Segment
from kvledger.store.segment_files import SegmentFiles
from kvledger.store.ttl import Clock

log = logging.getLogger("kvledger.store")

MTIME_SLACK_NS = 50_000_000  # a directory mtime younger than this may still change within its tick


class IndexUpkeep:
    """Loads segments into `index` and forgets vanished ones. The caller holds the store's lock."""

    def __init__(self, files: SegmentFiles, index: MemoryIndex, clock: Clock) -> None:
        self.files = files
        self.index = index
        self.clock = clock
        self.bad_segments: list[str] = []
        self.duplicates = 0          # blocks found in two segments (the newer is kept)
        self._dir_mtime: int | None = None

    def stale(self, force: bool = False) -> bool:
        """Whether the directory may have changed since the last listing (one stat)."""
        try:
            mtime = self.files.mtime_ns()
        except OSError:
            return False
        return force or mtime != self._dir_mtime

    def sync(self) -> None:
        """List the directory: load the segments other writers added, forget those they removed."""
        try:
            mtime = self.files.mtime_ns()
            names = self.files.names()
        except OSError as e:
            log.warning("cannot list %s: %s", self.files.seg_dir, e)
            return
        for name in [n for n in self.index.segment_names() if n not in names]:
            self.forget(self.index.segment(name))
        for name in sorted(names - set(self.index.segment_names()) - set(self.bad_segments)):
            self.load(name)
        # an mtime inside the current clock tick may not change again for a later rename: look again
        self._dir_mtime = None if time.time_ns() - mtime < MTIME_SLACK_NS else mtime

    def forget(self, seg: Segment | None) -> None:
        if seg is None:
            return
        self.index.forget_segment(seg)
        self.files.close_fd(seg.name)

    def load(self, name: str) -> None:
        try:
            got = self.files.read_meta(name)
        except sg.BadSegment as e:
            log.warning("segment %s is bad (%s): ignored until `kvledger store verify` removes it", name, e)
            self.bad_segments.append(name)
            return
        except OSError as e:
            log.warning("cannot read segment %s: %s", name, e)
            return
        if got is None:
            return
        meta, file_size = got
        seg = Segment(name, meta.namespace, meta.ttl_class, meta.ttl_s, meta.created,
                      meta.layout.mutable_off, file_size, [None] * meta.layout.n)
        self.index.add_segment(seg)
        now = self.clock()
        for i, (key, parent, pos, size, xxh, offset) in enumerate(meta.entries):
            expiry, hit = _sane_times(meta, i)
            if meta.flags[i] != sg.FLAG_LIVE or offset + size > file_size:
                seg.trim = True
            elif expiry < now:  # expired before we opened: gc removes it and counts it
                seg.trim = True
                seg.expired_at_open += 1
            else:
                if (older := self.index.get(key)) is not None:
                    # another writer's copy: the newer one wins (a block written again after a damaged copy was
                    # found supersedes it here too), keeping the later expiry and hit; the older is flagged dead
                    self.duplicates += 1
                    expiry, hit = max(expiry, older.expiry), max(hit, older.last_hit)
                    self.index.remove(older)
                self.index.add(Entry(key, parent, pos, size, xxh, offset, seg, i, expiry, hit))


def _sane_times(meta: sg.SegmentMeta, i: int) -> tuple[float, float]:
    """(expiry, last hit) of entry i, clamped: the mutable arrays carry no checksum (segment.py)."""
    expiry, hit = meta.expiry[i], meta.last_hit[i]
    if not math.isfinite(expiry) or expiry < meta.created + meta.ttl_s:
        expiry = meta.created + meta.ttl_s
    if not math.isfinite(hit) or not meta.created <= hit <= expiry:
        hit = meta.created
    return expiry, hit
