"""The simulator's caches: a byte-bounded block store with TTL and LRU, and a slot-bounded state pool.

Times are simulated seconds; sizes are bytes. Both are plain in-memory models of what the
block ledger (storage tier) and the state ledger (host-memory slot pool) keep.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable


class SimBlockStore:
    """Entries (a block, or a snapshot kept on storage) with a size, a unit count and an expiry, in groups.

    Invariants: `bytes` == the sum of live entries' sizes <= `capacity` after every `put` (a put past it
    evicts down to `low_watermark` × capacity, as the live store does);
    an entry is gone once `now >= expiry`; a touch (hit or rewrite) renews the expiry
    (TTL refreshed on a hit) and makes its group most recently used; eviction takes the least
    recently used group first, whole. A group is one entry unless `put` names another: the live
    store's segment (the blocks one write added), which it evicts whole and whose blocks a hit on any
    of them refreshes together (their expiry only moves forward). Units: how many 128-token blocks an
    entry holds (its usable prefix).
    """

    def __init__(self, capacity: float = math.inf, low_watermark: float = 1.0) -> None:
        assert capacity >= 0 and 0 < low_watermark <= 1
        self.capacity = capacity
        self.low_watermark = low_watermark
        self.bytes = 0
        self.evicted_bytes = 0
        self.expired_bytes = 0
        self._entries: dict[Hashable, list] = {}   # key -> [units, size, expiry, group]
        self._groups: OrderedDict[Hashable, dict[Hashable, None]] = OrderedDict()   # least recently used first
        self._expiries: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def units(self, key: Hashable, now: float) -> int:
        """Units held under `key` (0: absent or expired). Does not touch."""
        entry = self._entries.get(key)
        if entry is None:
            return 0
        if entry[2] <= now:
            self._drop(key, expired=True)
            return 0
        return entry[0]

    def touch(self, key: Hashable, now: float, ttl: float) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        self._refresh(key, entry, now + ttl)

    def put(self, key: Hashable, units: int, size: int, now: float, ttl: float, group: Hashable = None) -> bool:
        """Store or refresh `key` (a new one joins `group`, default: its own); evict LRU groups to fit. False when
        it cannot fit at all."""
        assert units > 0 and size > 0
        if size > self.capacity:
            return False
        entry = self._entries.get(key)
        if entry is not None and entry[2] > now:
            if units > entry[0]:
                self.bytes += size - entry[1]
                entry[0], entry[1] = units, size
        else:
            if entry is not None:
                self._drop(key, expired=True)
            g = key if group is None else group
            entry = [units, size, math.inf, g]
            self._entries[key] = entry
            self._groups.setdefault(g, {})[key] = None
            self.bytes += size
        self._refresh(key, entry, now + ttl)
        if self.bytes <= self.capacity:
            return True
        self._evict_to(self.capacity * self.low_watermark)
        return key in self._entries

    def resize(self, capacity: float) -> None:
        """A new capacity; least recently used groups are evicted down to it (not down to the low watermark)."""
        assert capacity >= 0
        self.capacity = capacity
        self._evict_to(capacity)

    def expire(self, now: float) -> None:
        """Drop every entry whose expiry has passed (keeps `bytes` exact for the size-over-time series)."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, _, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is not None and entry[2] == expiry:
                self._drop(key, expired=True)

    def _refresh(self, key: Hashable, entry: list, expiry: float) -> None:
        """`key` expires at `expiry`, the rest of its group no sooner; the group becomes the most recently used."""
        group = entry[3]
        self._groups.move_to_end(group)
        self._set_expiry(key, entry, expiry)
        if group != key:
            for other in self._groups[group]:
                e = self._entries[other]
                if other != key and e[2] < expiry:
                    self._set_expiry(other, e, expiry)

    def _evict_to(self, limit: float) -> None:
        while self.bytes > limit:
            _, keys = next(iter(self._groups.items()))
            for key in list(keys):
                self.evicted_bytes += self._entries[key][1]
                self._drop(key)

    def _set_expiry(self, key: Hashable, entry: list, expiry: float) -> None:
        entry[2] = expiry
        if expiry != math.inf:
            self._seq += 1
            heapq.heappush(self._expiries, (expiry, self._seq, key))

    def _drop(self, key: Hashable, expired: bool = False) -> None:
        units, size, _, group = self._entries.pop(key)
        members = self._groups[group]
        del members[key]
        if not members:
            del self._groups[group]
        self.bytes -= size
        if expired:
            self.expired_bytes += size


class StatePool:
    """A host-memory snapshot pool of `slots` snapshots, LRU (the state ledger of one engine)."""

    def __init__(self, slots: int) -> None:
        assert slots >= 0
        self.slots = slots
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: Hashable) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def put(self, key: Hashable, *, extra: bool = False) -> None:
        """Keep `key`, evicting the least recently used past `slots`. An `extra` (rule 4″) enters as the least
        recently used, as `state.pool.SlotPool.put(extra=True)` does; a key already held becomes the most recent."""
        if self.slots == 0:
            return
        if key in self._keys:
            self._keys.move_to_end(key)
            return
        while len(self._keys) >= self.slots:   # room first, so an extra is not its own victim
            self._keys.popitem(last=False)
        self._keys[key] = None
        if extra:
            self._keys.move_to_end(key, last=False)


class DevicePool:
    """One engine's device KV pool, which is also its prefix cache in front of the store (engine/block_pool.py).

    `blocks` in all (128-token blocks). The blocks its unfinished requests took at admission are `held`
    until they are keyed (a prompt's full blocks once its prefill ends: `give_back` them, then `keep`)
    or released (the rest, at the request's end); the others keep keyed blocks in least-recently-used
    order, evicted when an admission needs room. No TTL: the device keeps what it
    computed as long as nothing else needs the space. (A keyed block still in use is not protected from
    eviction here, as it is on the engine: an approximation while requests run.)"""

    def __init__(self, blocks: int) -> None:
        assert blocks > 0
        self.blocks = blocks
        self.held = 0
        self.cache = SimBlockStore(blocks)

    def take(self, n: int) -> None:
        """An admission takes `n` blocks: keyed blocks are evicted, least recently used first, to make room."""
        self.held += n
        self.cache.resize(max(self.blocks - self.held, 0))

    def give_back(self, n: int) -> None:
        self.held = max(self.held - n, 0)
        self.cache.resize(max(self.blocks - self.held, 0))

    def keep(self, key: Hashable, units: int, now: float) -> None:
        """`key`'s `units` blocks are now findable on the device (refreshed if they were)."""
        self.cache.put(key, units, units, now, math.inf)
