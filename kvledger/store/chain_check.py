"""CHECK without probing every block: a binary search over the chain keys of a prompt.

Presence is prefix-closed along a chain: a put writes a chain head first (a block is only
written after CHECK matched its parent), and GC and eviction remove it tail first (a block's
segment never outlives its parent's: a hit refreshes the whole prefix, see lmdb_store). So the
present blocks of a prompt are keys[0:b] for one b, found in ⌈log2 n⌉ + 1 probes.

It can be briefly false (a concurrent put filling a hole, a corrupt block dropped mid-chain),
so what the search found gets a bounded check: `samples` positions spread evenly below b
are probed as well, and the first absent one cuts the answer there (the search repeats below
it, at most `rounds` times). Whatever is still wrong is caught by the read: a block reported
present that turns out absent or unreadable is a miss and a recompute (DESIGN.md rule 8).

Probes for n keys, all present: 1 + samples; none present: 1; a boundary at b: about log2 n + samples.
"""

from __future__ import annotations

from collections.abc import Callable


def leading_present(n: int, present: Callable[[int], bool], samples: int = 16, rounds: int = 4) -> int:
    """The number b of leading positions present, assuming presence is prefix-closed (checked, see module)."""
    assert n >= 0 and samples >= 0 and rounds >= 1
    hi = n
    for _ in range(rounds):
        b = _search(hi, present)
        cut = _first_absent_sample(b, present, samples)
        if cut is None:
            return b
        hi = cut
    return _search(hi, present) if hi else 0


def _search(n: int, present: Callable[[int], bool]) -> int:
    """Largest b ≤ n with position b − 1 present (0 when position 0 is absent), by bisection."""
    if n == 0 or not present(0):
        return 0
    if present(n - 1):
        return n
    lo, hi = 1, n - 1          # position lo − 1 present, position hi absent
    while lo < hi:
        mid = (lo + hi + 1) // 2   # is position mid − 1 present?
        if present(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _first_absent_sample(b: int, present: Callable[[int], bool], samples: int) -> int | None:
    """The lowest of `samples` evenly spread positions in (0, b − 1) that is absent, or None."""
    if b <= 2 or samples == 0:
        return None
    step = (b - 1) / (samples + 1)
    seen = set()
    for i in range(1, samples + 1):
        pos = int(i * step)
        if 0 < pos < b - 1 and pos not in seen:
            seen.add(pos)
            if not present(pos):
                return pos
    return None
