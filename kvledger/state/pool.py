"""Host-memory slot pool: fixed-size snapshot slots in one shared-memory segment.

One slot holds one snapshot's stored region (`ModelSpec.state_size_to_disk()` bytes:
1,415,040 B for deepseek-v4.1-flash), never the dropped region of the YoCo consumer
layers or the fp32 compression state. Slots are page-aligned (`stride` ≥ `slot_bytes`).

Invariants:
  - a key is in at most one slot; a stored snapshot is immutable (a second `put` of the
    same key refreshes its recency and keeps the first bytes);
  - a slot is visible to readers only once fully written (`put` fills a reserved slot
    outside the lock, then commits it);
  - eviction takes the least recently used unpinned slot; a pinned slot (being read or
    sent) is never evicted or overwritten under its reader;
  - `pin` and `unpin` pair up: every successful `pin(key)` is followed by one `unpin(key)`.

Thread-safe (one lock around the metadata; bytes are copied outside it). The metadata
lives in the creating process; another process maps the same bytes with `attach(name)`
(never `SharedMemory(name)` directly: on Python < 3.13 its resource tracker would remove
the segment when that other process exits). Only the creating pool unlinks the segment.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

import xxhash

from kvledger.core import KEY_BYTES, ModelSpec

PAGE = 4096


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a snapshot's bytes (computed once at `put`, verified by every puller)."""
    return xxhash.xxh3_64_intdigest(data)


running_checksum = xxhash.xxh3_64
"""`running_checksum()` is `checksum` fed piece by piece (`update`, then `intdigest()`): the same value for the same
bytes, so a puller checks each piece as it arrives instead of the whole snapshot after the last one. The class
itself, not a function returning one: an interpreter call less a pull."""


def attach(name: str) -> shared_memory.SharedMemory:
    """Map the segment of a pool created by another process, without owning it: this process's
    exit leaves it in place. Close the result with `.close()`, never `.unlink()`."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # registered by every mapping before 3.13
    return shm


@dataclass(slots=True)
class _Slot:
    key: bytes
    position: int     # token position the snapshot was taken at (a multiple of the block size)
    size: int         # bytes used in the slot, <= slot_bytes
    checksum: int     # xxh3-64 of those bytes
    stored_at: float  # unix seconds
    pins: int = 0
    tenant: str = ""  # whose snapshot it is (`core.tenant_of` of its namespace; "" when not given)


class Pinned(NamedTuple):
    """A snapshot held in place: `view` stays valid and unchanged until `unpin(key)`."""

    key: bytes
    view: memoryview
    position: int
    size: int
    checksum: int


class SnapshotPut(NamedTuple):
    stored: bool              # False only when every slot is pinned (or the data does not fit)
    evicted: list[bytes]      # keys that left the pool to make room


class SlotPool:
    """`capacity` slots of `slot_bytes` each in one shared-memory segment, LRU-evicted."""

    def __init__(self, slot_bytes: int, capacity: int, *, name: str | None = None) -> None:
        assert slot_bytes > 0 and capacity > 0
        self.slot_bytes = slot_bytes
        self.capacity = capacity
        self.stride = -(-slot_bytes // PAGE) * PAGE
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=self.stride * capacity)
        self._buf = self._shm.buf
        self._slots: list[_Slot | None] = [None] * capacity
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot; oldest first
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._reserved = 0
        self._lock = threading.Lock()
        self.on_evict: Callable[[list[bytes]], None] | None = None  # called outside the lock
        self.evictions = 0

    @classmethod
    def for_spec(cls, spec: ModelSpec, capacity_bytes: int, **kw: object) -> SlotPool:
        """A pool of as many whole slots of `spec`'s snapshot size as fit in `capacity_bytes`."""
        slot = spec.state_size_to_disk()
        if slot <= 0:
            raise ValueError(f"{spec.name} has no sliding-window state to keep")
        stride = -(-slot // PAGE) * PAGE
        if capacity_bytes < stride:
            raise ValueError(f"capacity {capacity_bytes} B holds no {slot}-byte slot")
        return cls(slot, capacity_bytes // stride, **kw)

    @property
    def name(self) -> str:
        return self._shm.name

    # --- writes ------------------------------------------------------------------

    def can_allocate(self) -> bool:
        """True when a `put` of a new key would find a slot (free, or an unpinned one to evict)."""
        with self._lock:
            return bool(self._free) or any(self._slots[i].pins == 0 for i in self._index.values())

    def _allocate(self) -> tuple[int | None, list[bytes]]:
        """Reserve a slot under the lock: a free one, else evict the LRU unpinned one."""
        if self._free:
            return self._free.pop(), []
        for key, idx in self._index.items():  # oldest first
            if self._slots[idx].pins == 0:
                del self._index[key]
                self._slots[idx] = None
                self.evictions += 1
                return idx, [key]
        return None, []

    def put(self, key: bytes, position: int, data: bytes | bytearray | memoryview, tenant: str = "", *,
            extra: bool = False) -> SnapshotPut:
        """Store a snapshot of `tenant` (copied into a slot); evicts the LRU unpinned slot when full. An `extra`
        snapshot (rules 4′ and 4″: a checkpoint, a branch point, a message end, where a prompt does not end) enters
        as the least recently used: it is the first to go unless a read promotes it before, so the extras never
        push out a chain's own (rule 4) windows by being newer, and a hot one (a system prompt's) stays."""
        assert len(key) == KEY_BYTES and position >= 0
        data = memoryview(data).cast("B")
        if data.nbytes > self.slot_bytes:
            return SnapshotPut(False, [])
        with self._lock:
            idx = self._index.get(key)
            if idx is not None:
                self._index.move_to_end(key)
                return SnapshotPut(True, [])
            idx, evicted = self._allocate()
            if idx is not None:
                self._reserved += 1
        if idx is not None:
            try:
                off = idx * self.stride
                self._buf[off:off + data.nbytes] = data
                slot = _Slot(key, position, data.nbytes, checksum(data), time.time(), tenant=tenant)
            except BaseException:
                with self._lock:
                    self._reserved -= 1
                    self._free.append(idx)
                raise
            with self._lock:
                self._reserved -= 1
                if key in self._index:  # a concurrent put of the same key won: keep its bytes
                    self._free.append(idx)
                else:
                    self._slots[idx] = slot
                    self._index[key] = idx
                    if extra:
                        self._index.move_to_end(key, last=False)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return SnapshotPut(idx is not None, evicted)

    def discard(self, key: bytes) -> bool:
        """Drop a snapshot now; False when absent or pinned (it then stays until evicted later)."""
        with self._lock:
            idx = self._index.get(key)
            if idx is None or self._slots[idx].pins:
                return False
            del self._index[key]
            self._slots[idx] = None
            self._free.append(idx)
            return True

    def discard_tenant(self, tenant: str) -> tuple[list[bytes], int]:
        """Drop every snapshot of `tenant` now (a forget); (their keys, how many stay because a reader pins them:
        those go once unpinned only by eviction, and no lookup names them once the directory forgets them)."""
        with self._lock:
            mine = [(k, i) for k, i in self._index.items() if self._slots[i].tenant == tenant]
            gone = [k for k, i in mine if not self._slots[i].pins]
            for k in gone:
                idx = self._index.pop(k)
                self._slots[idx] = None
                self._free.append(idx)
        return gone, len(mine) - len(gone)

    # --- reads -------------------------------------------------------------------

    def pin(self, key: bytes) -> Pinned | None:
        """Hold a snapshot in place for reading (marks it recently used); None when absent."""
        with self._lock:
            idx = self._index.get(key)
            if idx is None:
                return None
            slot = self._slots[idx]
            slot.pins += 1
            self._index.move_to_end(key)
            off = idx * self.stride
            return Pinned(key, self._buf[off:off + slot.size], slot.position, slot.size, slot.checksum)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            slot = self._slots[self._index[key]]
            assert slot.pins > 0, "unpin without pin"
            slot.pins -= 1

    def get(self, key: bytes) -> bytes | None:
        """A copy of a snapshot's bytes, or None."""
        pinned = self.pin(key)
        if pinned is None:
            return None
        try:
            return bytes(pinned.view)
        finally:
            pinned.view.release()
            self.unpin(key)

    def read_into(self, key: bytes, out: memoryview | bytearray) -> int | None:
        """Copy a snapshot into `out` (no allocation); its size, or None when absent or too big."""
        pinned = self.pin(key)
        if pinned is None:
            return None
        try:
            if pinned.size > len(out):
                return None
            memoryview(out)[:pinned.size] = pinned.view
            return pinned.size
        finally:
            pinned.view.release()
            self.unpin(key)

    def position(self, key: bytes) -> int | None:
        with self._lock:
            idx = self._index.get(key)
            return None if idx is None else self._slots[idx].position

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._index))

    def pinned_count(self) -> int:
        with self._lock:
            return sum(self._slots[i].pins > 0 for i in self._index.values())

    # --- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Unmap and remove the segment. Views still held by readers keep their pages alive."""
        self._buf = None
        with contextlib.suppress(BufferError):  # a reader still holds a view; the mapping goes when it does
            self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()

    def __enter__(self) -> SlotPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
