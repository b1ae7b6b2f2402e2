"""Which blocks GC removes, and in what order (pure planning; the stores do the removing).

Tails before heads: a chain is only as long as its leading present blocks, so removing a
head block makes every longer block of that chain unreachable while it still takes space.
Both plans order by chain position, highest first, among blocks that are equally due.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from kvledger.store.index import Entry

T = TypeVar("T")


def expired_tails_first(entries: Iterable[Entry], now: float) -> list[Entry]:
    """Entries whose expiry has passed, the highest chain positions first."""
    due = [e for e in entries if e.expiry < now]
    due.sort(key=lambda e: -e.pos)
    return due


def lru_tails_first(entries: Iterable[Entry], need_bytes: int) -> list[Entry]:
    """The least recently hit entries (ties: highest chain position first) adding up to ≥ need_bytes."""
    if need_bytes <= 0:
        return []
    order = sorted(entries, key=lambda e: (e.last_hit, -e.pos))
    out: list[Entry] = []
    freed = 0
    for e in order:
        if freed >= need_bytes:
            break
        out.append(e)
        freed += e.size
    return out


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    assert size > 0
    for i in range(0, len(items), size):
        yield items[i:i + size]
