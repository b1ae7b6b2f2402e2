"""The in-process index of the embedded store: chain key → entry, and the CHECK walk.

CHECK reads no KV byte: it walks the keys of a prompt through a dict and stops at the
first key that is absent or expired. A hit refreshes the entries it walked (expiry and
last hit, in memory; the file store writes them back to the segments on flush).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Segment:
    """One segment file as the index knows it; `entries[i]` is None once entry i is gone."""

    name: str
    namespace: str
    ttl_class: str
    ttl_s: float
    created: float
    mutable_off: int
    file_size: int
    entries: list[Entry | None] = field(default_factory=list)
    dirty: bool = False       # expiry / last hit / flags changed since the last flush
    trim: bool = False        # entries past the last live one may be cut off the file
    expired_at_open: int = 0  # entries already expired when this process loaded the segment (gc counts them)

    def live(self) -> Iterator[Entry]:
        return (e for e in self.entries if e is not None)


@dataclass(slots=True, eq=False)
class Entry:
    """Metadata of one stored block (times in epoch seconds, offset and size in bytes)."""

    key: bytes
    parent: bytes
    pos: int          # position of the block in its chain (0 = first block of a prompt)
    size: int
    xxh: int          # xxh3-64 of the block's bytes
    offset: int       # byte offset of the block in its segment
    seg: Segment
    idx: int          # index of the entry in its segment
    expiry: float
    last_hit: float


class MemoryIndex:
    """key → Entry. Invariant: every entry in `entries` is `seg.entries[idx]` of its segment."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, keys: Sequence[bytes], now: float, ttl_s: float) -> int:
        """Number of leading keys present with expiry ≥ now; refreshes them to expiry ≥ now + ttl_s."""
        get = self.entries.get
        hits: list[Entry] = []
        add = hits.append
        for k in keys:
            e = get(k)
            if e is None or e.expiry < now:
                break
            add(e)
        if hits:
            new_expiry = now + ttl_s
            seg = None
            for e in hits:
                e.last_hit = now
                if e.expiry < new_expiry:
                    e.expiry = new_expiry
                if e.seg is not seg:  # a prefix lies in few segments: mark each dirty once per run
                    seg = e.seg
                    seg.dirty = True
        return len(hits)

    def add(self, e: Entry) -> None:
        old = self.entries.get(e.key)
        if old is not None:
            self.remove(old)
        self.entries[e.key] = e

    def remove(self, e: Entry) -> None:
        """Forget `e` (idempotent); its segment learns that entry `idx` is gone."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        if e.seg.entries[e.idx] is e:
            e.seg.entries[e.idx] = None
            e.seg.dirty = e.seg.trim = True
