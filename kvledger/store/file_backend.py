"""The embedded block store: segment files in a directory, metadata indexed in the process.

Write path: the blocks of one put call go into one new segment (segment.py), written with
`writev` under a temporary name, fsynced once, renamed into place (all or nothing). Any byte
that does reach the disk wrong (power cut, bit rot) fails its checksum on read: a miss. Writers
of one directory serialize on an flock of `DIR/.lock` and re-read the directory first, so
two processes storing the same chain write each block once.

Read path: blocks of a prefix that lie back to back in a segment are read with one
`preadv` straight into the caller's buffers; each is checked against its xxh3-64. A
mismatch or a short read is a miss (counted), and the entry is dropped.

The jobs live in their own modules: segment_files.py (the directory's I/O), index.py (the
index and CHECK), file_index.py (index upkeep), file_read.py (reads), file_gc.py (GC,
eviction, write-back), file_inspect.py (stats and verify). This class ties them together under one lock.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import xxhash

from kvledger.store import segment as sg
from kvledger.store.backend import (
    BlockInfo,
    Buffer,
    ChainWrite,
    Counters,
    GcResult,
    PutResult,
    StoreStats,
    VerifyResult,
    probe_folder,
    stored_name,
)
from kvledger.store.file_gc import Collector
from kvledger.store.file_index import IndexUpkeep
from kvledger.store.file_read import BlockReader
from kvledger.store.index import Entry, MemoryIndex, Segment
from kvledger.store.segment_files import SegmentFiles, bytes_view
from kvledger.store.ttl import Clock, wall_clock

log = logging.getLogger("kvledger.store")

WRITEBACK_S = 5.0  # a hit's refreshed expiry reaches its segment file at most this long after the hit


class FileStore:
    """Blocks in segment files under `root/segments`; see the module docstring.

    `capacity_bytes`: when live bytes would exceed it, put evicts least recently hit blocks
    (tails first) down to `low_watermark` × capacity. `fsync=False` skips the fsyncs (tests).

    Durable refresh: a CHECK refreshes expiries in memory only (no I/O on its path); a writer
    thread, started by the first hit, writes the refreshed segments back every `writeback_s`
    seconds under the directory's flock, merged with what other processes wrote (the later
    expiry wins, a block another process removed stays removed). A hit is therefore durable for
    every process within `writeback_s` (default 5 s), and at `close`.
    """

    backend = "file"

    def __init__(self, root: str | os.PathLike, *, capacity_bytes: int | None = None, fsync: bool = True,
                 clock: Clock = wall_clock, create: bool = True, low_watermark: float = 0.9,
                 writeback_s: float = WRITEBACK_S) -> None:
        self.root = Path(root)
        if not create and not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such directory")
        if capacity_bytes is not None and not capacity_bytes >= 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes!r}")
        if not 0 < low_watermark <= 1 or not 0 < writeback_s < math.inf:
            raise ValueError("need 0 < low_watermark <= 1 and 0 < writeback_s < inf")
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.writeback_s = writeback_s
        self.clock = clock
        self.counters = Counters()
        self.files = SegmentFiles(self.root, fsync=fsync)
        self.index = MemoryIndex()
        self.upkeep = IndexUpkeep(self.files, self.index, clock)
        self.collector = Collector(self.files, self.index, self.upkeep, self.counters)
        self.reader = BlockReader(self.files, self.index, self.counters)
        self._lock = threading.RLock()
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._closing = threading.Event()
        self.files.remove_stale_tmp()
        self.refresh()

    @property
    def live_bytes(self) -> int:
        return self.index.live_bytes

    @property
    def seg_dir(self) -> Path:
        """The folder of the segment files (`root/segments`)."""
        return self.files.seg_dir

    def refresh(self, force: bool = False) -> None:
        """Load segments other writers added and forget those they removed (one stat when nothing changed).

        Never waits: while another thread of this process holds the store (a put in its fsync), the
        index stays as it is for this call. `force` lists the directory whatever its mtime says."""
        if not self.upkeep.stale(force) or not self._lock.acquire(blocking=False):
            return
        try:
            self.upkeep.sync()
        finally:
            self._lock.release()

    # --- CHECK -----------------------------------------------------------------

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Leading present blocks, from the in-process index (no block byte read)."""
        self.refresh()
        n = self.index.match(keys, self.clock(), ttl_s)
        if n and self._writer is None:
            self._start_writer()
        return n

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self.refresh()
        now = self.clock()
        return [self.index.live(k, now) is not None for k in keys]

    def blocks(self) -> Iterator[BlockInfo]:
        self.refresh()
        with self._lock:
            snapshot = list(self.index.values())
        for e in snapshot:
            s = e.seg
            yield BlockInfo(e.key, e.parent, e.pos, e.size, s.created, e.expiry, s.namespace, s.ttl_class)

    # --- write -----------------------------------------------------------------

    def put(self, write: ChainWrite) -> PutResult:
        n = len(write.keys)
        try:
            with self._lock, self.files.flock():
                self.refresh()
                now = self.clock()
                sel = [i for i, k in enumerate(write.keys) if self.index.live(k, now) is None]
                skipped = n - len(sel)
                self.counters.blocks_skipped += skipped
                if not sel:
                    return PutResult(0, skipped, 0)
                views = [bytes_view(write.blocks[i]) for i in sel]
                if not self._make_room(sum(v.nbytes for v in views)):
                    self.counters.put_failures += 1
                    return PutResult(0, skipped, len(sel))
                self._write_segment(write, sel, views, now)
                return PutResult(len(sel), skipped, 0)
        except OSError as e:
            log.warning("put of %d blocks to %s failed: %s", n, self.root, e)
            self.counters.put_failures += 1
            return PutResult(0, 0, n)

    def _make_room(self, incoming: int) -> bool:
        """Evict down to the low watermark if `incoming` bytes would pass the capacity; False if they never fit."""
        cap = self.capacity_bytes
        if cap is None:
            return True
        if incoming > cap:
            log.warning("put of %d bytes exceeds the store's capacity %d", incoming, cap)
            return False
        if self.live_bytes + incoming > cap:
            target = int(cap * self.low_watermark) - incoming
            self.collector.evict(self.live_bytes - max(target, 0))
        return True

    def _write_segment(self, write: ChainWrite, sel: list[int], views: list[memoryview], now: float) -> None:
        expiry = now + write.ttl_s
        ns_len, cls_len = len(stored_name(write.namespace)), len(stored_name(write.ttl_class))
        layout = sg.Layout.of(len(sel), ns_len, cls_len)
        rows: list[tuple[bytes, bytes, int, int, int, int]] = []
        offset = layout.data_off
        for i, v in zip(sel, views):
            parent = write.keys[i - 1] if i > 0 else write.parent
            rows.append((write.keys[i], parent, write.start_pos + i, v.nbytes, xxhash.xxh3_64_intdigest(v), offset))
            offset += v.nbytes
        meta = sg.encode_meta(write.namespace, write.ttl_class, write.ttl_s, now, rows, [expiry] * len(rows))
        name = self.files.write(meta, views)
        seg = Segment(name, write.namespace, write.ttl_class, write.ttl_s, now, layout.mutable_off, offset,
                      [None] * len(rows))
        self.index.add_segment(seg)
        for j, (key, parent, pos, size, xxh, off) in enumerate(rows):
            self.index.add(Entry(key, parent, pos, size, xxh, off, seg, j, expiry, now))
        self.counters.blocks_written += len(rows)
        self.counters.bytes_written += offset - layout.data_off

    # --- read ------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Buffer]) -> list[int]:
        """Read blocks into `bufs` (each at least the block's size); per key its size, or -1 for a miss."""
        if len(keys) != len(bufs):
            raise ValueError(f"one buffer per key: {len(keys)} keys, {len(bufs)} buffers")
        with self._lock:
            self.refresh()
            out = self.reader.get_into(keys, bufs, self.clock())
            if self.reader.damaged:
                damaged, self.reader.damaged = self.reader.damaged, set()
                self._reclaim(damaged, "flagging damaged blocks dead")
            return out

    # --- removal, GC, write-back -------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            victims = [e for k in keys if (e := self.index.get(k)) is not None]
            for e in victims:
                self.index.remove(e)
            self._reclaim({e.seg for e in victims}, "delete")
        return len(victims)

    def _reclaim(self, segs: set[Segment], what: str) -> None:
        """Persist the dead flags of entries dropped from `segs` and give their space back (lock held)."""
        try:
            with self.files.flock():
                self.collector.reclaim(segs)
        except OSError as err:
            log.warning("%s in %s: reclaiming failed: %s", what, self.root, err)

    def gc(self, batch: int = 4096) -> GcResult:
        """Remove expired blocks (tails first, `batch` at a time), then evict down to capacity."""
        if batch < 1:
            raise ValueError("batch must be >= 1")
        freed0 = self.disk_bytes()
        try:
            with self._lock, self.files.flock():
                self.upkeep.sync()
                expired, n_batches = self.collector.expire(self.clock(), batch)
                evicted = 0
                if self.capacity_bytes is not None and self.live_bytes > self.capacity_bytes:
                    evicted = self.collector.evict(self.live_bytes - int(self.capacity_bytes * self.low_watermark))
                    n_batches += 1
                self.collector.flush()
        except OSError as e:
            log.warning("gc of %s stopped: %s", self.root, e)
            return GcResult(0, 0, 0, 0)
        return GcResult(expired, evicted, max(freed0 - self.disk_bytes(), 0), n_batches)

    def flush(self) -> None:
        """Write refreshed expiries back now (the write-back thread does it every `writeback_s`)."""
        with self._lock:
            if not any(seg.dirty for seg in self.index.segments):
                return
            try:
                with self.files.flock():
                    self.collector.flush()
            except OSError as e:
                log.warning("flush of %s failed: %s", self.root, e)

    def _start_writer(self) -> None:
        """The thread that makes refreshed expiries durable (see the class docstring)."""
        with self._writer_lock:  # not the store's lock: a CHECK never waits for a put
            if self._writer is not None or self._closing.is_set():
                return
            self._writer = threading.Thread(target=self._writeback_loop, name="kvledger-writeback", daemon=True)
            self._writer.start()

    def _writeback_loop(self) -> None:
        while not self._closing.wait(self.writeback_s):
            self.flush()

    # --- operator views ------------------------------------------------------------

    def disk_bytes(self) -> int:
        return sum(s.file_size for s in self.index.segments)

    def probe(self) -> str | None:
        return probe_folder(self.root / "segments")

    def stats(self) -> StoreStats:
        from kvledger.store.file_inspect import file_stats

        with self._lock:
            self.refresh()
            return file_stats(self)

    def verify(self, remove: bool = True) -> VerifyResult:
        """Read every live block and check it; bad blocks (and unreadable segments) are reported and removed."""
        from kvledger.store.file_inspect import file_verify

        with self._lock:
            self.refresh()
            return file_verify(self, remove)

    def close(self) -> None:
        with self._writer_lock:
            self._closing.set()
        if self._writer is not None:
            self._writer.join()
        with self._lock:
            self.flush()
            self.files.close()

    def __enter__(self) -> FileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
