"""Which blocks GC removes, and in what order (pure planning; the stores do the removing).

Tails before heads: a chain is only as long as its leading present blocks, so a block
whose parent is gone can never be matched again. Both plans therefore judge a block by its
*effective* time: the minimum of its own time and its parent's effective time (an orphan,
a block at position > 0 whose parent is absent, has effective time −∞). A child is thus
never kept longer than its parent, and ties go to the highest chain position first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from kvledger.store.index import Entry

T = TypeVar("T")


def effective(entries: Iterable[Entry], attr: str) -> list[tuple[float, Entry]]:
    """(effective value of `attr`, entry) for every entry, in chain-position order."""
    order = sorted(entries, key=lambda e: e.pos)
    eff: dict[bytes, float] = {}
    out = []
    for e in order:
        own = getattr(e, attr)
        if e.pos > 0:
            own = min(own, eff.get(e.parent, -math.inf))
        eff[e.key] = own
        out.append((own, e))
    return out


def expired_tails_first(entries: Iterable[Entry], now: float) -> list[Entry]:
    """Entries whose effective expiry has passed (orphans included), the highest chain positions first."""
    due = [e for t, e in effective(entries, "expiry") if t < now]
    due.sort(key=lambda e: -e.pos)
    return due


def lru_tails_first(entries: Iterable[Entry], need_bytes: int) -> list[Entry]:
    """Least recently hit first (effective last hit; ties: highest chain position first), ≥ need_bytes."""
    if need_bytes <= 0:
        return []
    order = sorted(effective(entries, "last_hit"), key=lambda te: (te[0], -te[1].pos))
    out: list[Entry] = []
    freed = 0
    for _, e in order:
        if freed >= need_bytes:
            break
        out.append(e)
        freed += e.size
    return out


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    assert size > 0
    for i in range(0, len(items), size):
        yield items[i:i + size]
