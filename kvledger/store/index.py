"""The index of the embedded store: chain key → entry, segment name → segment, and the CHECK walk.

CHECK reads no KV byte: it walks the keys of a prompt through a dict and stops at the
first key that is absent or expired. A hit refreshes the entries it walked (expiry and
last hit, in memory; the file store writes them back to the segments, see file_backend.py).

`MemoryIndex` is the only thing that adds or removes entries: the file store goes through
its methods (`add`, `remove`, `add_segment`, `forget_segment`), never through its dicts.
A persisted index (issue 12) implements the same methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

IOV_MAX = 1024  # most buffers one preadv takes


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
    dirty: bool = False       # expiry / last hit / flags changed since the last write-back
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
    """key → Entry and name → Segment, in this process's memory.

    Invariants: every entry in `entries` is `seg.entries[idx]` of its segment, and that segment
    is in `segments`; `live_bytes` is the sum of the sizes of the entries in `entries`.
    """

    __slots__ = ("_entries", "_segments", "live_bytes")

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._segments: dict[str, Segment] = {}
        self.live_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def live(self, key: bytes, now: float) -> Entry | None:
        """The entry of `key` if it is present and unexpired at `now`."""
        e = self._entries.get(key)
        return e if e is not None and e.expiry >= now else None

    def values(self) -> Iterable[Entry]:
        return self._entries.values()

    def keys(self) -> Iterable[bytes]:
        return self._entries.keys()

    def match(self, keys: Sequence[bytes], now: float, ttl_s: float) -> int:
        """Number of leading keys present with expiry ≥ now; refreshes them to expiry ≥ now + ttl_s."""
        get = self._entries.get
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
        """Index `e` (its segment is already added); an older entry of the same key is removed."""
        old = self._entries.get(e.key)
        if old is not None:
            self.remove(old)
        e.seg.entries[e.idx] = e
        self._entries[e.key] = e
        self.live_bytes += e.size

    def remove(self, e: Entry) -> None:
        """Forget `e` (idempotent); its segment learns that entry `idx` is gone."""
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
            self.live_bytes -= e.size
        if e.seg.entries[e.idx] is e:
            e.seg.entries[e.idx] = None
            e.seg.dirty = e.seg.trim = True

    # --- segments ----------------------------------------------------------------------

    @property
    def segments(self) -> Iterable[Segment]:
        return self._segments.values()

    def segment(self, name: str) -> Segment | None:
        return self._segments.get(name)

    def segment_names(self) -> Iterable[str]:
        return self._segments.keys()

    def add_segment(self, seg: Segment) -> None:
        self._segments[seg.name] = seg

    def forget_segment(self, seg: Segment) -> None:
        for e in list(seg.live()):
            self.remove(e)
        self._segments.pop(seg.name, None)


def runs(hits: Iterable[tuple[int, Entry]]) -> Iterator[list[tuple[int, Entry]]]:
    """Group (buffer index, entry) pairs, in order, into runs that lie back to back in one segment
    (at most IOV_MAX each): what one preadv can read."""
    run: list[tuple[int, Entry]] = []
    for i, e in hits:
        if run:
            last = run[-1][1]
            if last.seg is not e.seg or last.offset + last.size != e.offset or len(run) >= IOV_MAX:
                yield run
                run = []
        run.append((i, e))
    if run:
        yield run
