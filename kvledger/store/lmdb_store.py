"""`LmdbStore`: segment files indexed by a persisted LMDB index (lmdb_index.py) that every process shares.

    DIR/index.lmdb/            the index (open in O(1); memory: the pages a process touches)
    DIR/segments/XX/NAME.kvs   segment files (segment.py format), 256 folders; the previous design's
                               segments stay at DIR/segments/NAME.kvs, indexed by the migration
    DIR/tmp/                   segments being written (a crash leaves them here: removed at open)

Write path: dedupe against the index (a read snapshot), write the segment to tmp/, fsync, rename
into segments/XX/, then one write transaction indexes its blocks (a key another process indexed
meanwhile is skipped). No directory is ever listed on this path. A crash before the commit
leaves a file the index does not know (`verify` removes it); never an index entry without bytes.

CHECK: a binary search over the prompt's keys (chain_check.py) in one read snapshot, then a
walk from the found tail to the chain's head through the segments' `head_parent`, one step per
segment, to note the refresh of those segments (refresher.py): no write on the CHECK path.
`match_explained` reads, in the same snapshot, why the first absent key is absent: its record
past its expiry (expired at that expiry, before GC removed it) or its tombstone (lmdb_tombs.py:
GC, eviction and damaged reads bury what they remove); nothing more when every key is present.

Read path: blocks back to back in one segment are read with one `preadv` into the caller's
buffers and checked against their xxh3-64; a mismatch or short read is a miss, and the block is
dropped from the index (if the index still names those bytes).

Local only: every open writes (the LMDB lock file, tmp/, a migration's index), and LMDB's locks and mmap
do not hold across machines. So a folder that is a cluster store (it holds `shared_files.VOLUME_FILE`: its
index is on Redis) or lies on a network or FUSE filesystem is refused before anything is written there.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import suppress
from pathlib import Path

import lmdb

from kvledger.store import lmdb_forget, lmdb_gc, lmdb_upkeep, lmdb_write
from kvledger.core.attribution import MissCause
from kvledger.store.backend import (BlockInfo, ChainWrite, Dest, Counters, GcResult, Gone, Match, PutResult,
                                    StoreStats, VerifyResult, probe_folder, shown_name)
from kvledger.store.chain_check import leading_present
from kvledger.store.forget import Forgotten
from kvledger.store.index_pin import IndexPin
from kvledger.store.lmdb_index import BLOCK, INDEX_DIR, BlockRec, LmdbIndex, SegRec, data_file
from kvledger.store.lmdb_tombs import DEFAULT_CAP, Tombstones
from kvledger.store.quota import Quotas
from kvledger.store.segment_files import HOST, Location, PartDone, SegmentFiles, bytes_view
from kvledger.store.refresher import Refresher
from kvledger.store.shared_files import VOLUME_FILE
from kvledger.store.ttl import Clock, wall_clock
from kvledger.util.filesystem import filesystem_type, is_network_type
from kvledger.util.private_file import private_dir

log = logging.getLogger("kvledger.store")

SEGMENTS = "segments/"  # the prefix of every segment path the index records (relative to the store's root)
REFRESH_TXN = 256      # segments refreshed per write transaction
REFRESH_GRAIN_S = 1.0  # a hit refreshes expiry to ≥ now + ttl − this: one walk per chain tail per second


class NotEmbeddedFolder(ValueError):
    """A folder the embedded store refuses to open (see the module docstring): nothing was written there."""


def check_local_folder(root: Path) -> None:
    """Raise `NotEmbeddedFolder` when `root` is a cluster store or lies on a network/FUSE filesystem; reads
    only (a stat, mountinfo). OSError when the folder does not answer (a dead mount)."""
    if (root / VOLUME_FILE).exists():
        raise NotEmbeddedFolder(f"{root} is a cluster store ({VOLUME_FILE} inside): its index is on Redis, "
                                "not in an embedded LMDB index")
    fstype = filesystem_type(root)
    if fstype is not None and is_network_type(fstype):
        raise NotEmbeddedFolder(f"{root} is on a {fstype} filesystem: the embedded store's LMDB index needs a "
                                "local one")


def _open_index(root: Path, sync: bool) -> LmdbIndex:
    """The index; one LMDB cannot read is set aside and rebuilt from the segment files (lmdb_upkeep.migrate)."""
    path = root / INDEX_DIR
    try:
        return LmdbIndex(path, sync=sync)
    except (lmdb.CorruptedError, lmdb.InvalidError, lmdb.VersionMismatchError) as e:
        aside = path.with_name(f"index.lmdb.bad-{int(time.time())}")
        log.warning("index %s unreadable (%s): set aside as %s, rebuilt from the segments", path, e, aside.name)
        os.rename(path, aside)
        return LmdbIndex(path, sync=sync)


class LmdbStore:
    """The embedded block store at production scale; see the module docstring.

    `capacity_bytes`: when live bytes would exceed it, put evicts least recently hit segments
    (tails first) down to `low_watermark` × capacity. `fsync=False` skips fsyncs (tests, bench builds).
    `tombstones`: how many tombstones of removed blocks the index keeps at most (oldest dropped).
    `pin_index`: keep the index file in memory while the store is open (index_pin.py): for the one long-lived
    process of a node that serves from it, not for each process that opens the store.
    `quotas`: the guarantees eviction keeps (quota.py), recorded in the index for `kvledger store stats`; None:
    those the index records (what the server that owns the store set; none if it set none)."""

    backend = "file"

    def __init__(self, root: str | os.PathLike, *, capacity_bytes: int | None = None, fsync: bool = True,
                 clock: Clock = wall_clock, create: bool = True, low_watermark: float = 0.9,
                 tombstones: int = DEFAULT_CAP, pin_index: bool = False, quotas: Quotas | None = None) -> None:
        self.root = Path(root)
        if not create and not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such directory")
        assert capacity_bytes is None or capacity_bytes > 0
        assert 0 < low_watermark <= 1
        check_local_folder(self.root)
        private_dir(self.root / "segments")   # 0700 (the root too, when made here): whatever the umask (DESIGN)
        private_dir(self.root / "tmp")
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.clock = clock
        self.counters = Counters()
        self.index = _open_index(self.root, fsync)
        self.tombs = Tombstones(self.index, tombstones)
        self.refresher = Refresher(self._write_refresh)
        self.writer = lmdb_write.Writer(self.index, self.root, fsync, self._expiry, self.unlink)
        self.files = SegmentFiles(self.root, fsync=fsync)   # reads by location (paths under segments/)
        self._walked: dict[bytes, float] = {}   # chain tail → expiry its last walk noted (this process)
        lmdb_upkeep.remove_dead_tmp(self.root / "tmp", HOST)
        lmdb_upkeep.migrate(self.index, self.root)
        lmdb_upkeep.build_buckets(self.index)
        self.quotas = lmdb_upkeep.settle_quotas(self.index, quotas)
        self.collector = lmdb_gc.Collector(self.index, self.tombs, self.unlink, self.flush,
                                           functools.partial(lmdb_upkeep.rewrite_segment, self.get_into, self.writer),
                                           self.counters, capacity_bytes, low_watermark, str(self.root), self.quotas)
        self.pin = IndexPin(str(data_file(self.root))).start() if pin_index else None

    # --- CHECK -----------------------------------------------------------------

    def _expiry(self, txn: lmdb.Transaction, seg_id: int, cache: dict[int, float]) -> float:
        exp = cache.get(seg_id)
        if exp is None:
            seg = self.index.seg(txn, seg_id)
            exp = -1.0 if seg is None else max(seg.expiry, self.refresher.expiry(seg_id))
            cache[seg_id] = exp
        return exp

    def _live(self, txn: lmdb.Transaction, key: bytes, now: float, cache: dict[int, float]) -> BlockRec | None:
        rec = self.index.block(txn, key)
        if rec is None or self._expiry(txn, rec.seg, cache) < now:
            return None
        return rec

    def _live_many(self, txn: lmdb.Transaction, keys: Sequence[bytes], now: float,
                   cache: dict[int, float]) -> list[BlockRec | None]:
        """`_live` of each key, looked up in one C-level call."""
        with txn.cursor(db=self.index.blocks) as cur:
            found = dict(cur.getmulti(keys))
        recs: list[BlockRec | None] = []
        for k in keys:
            raw = found.get(k)
            rec = None if raw is None else BlockRec(*BLOCK.unpack(raw))
            recs.append(rec if rec is not None and self._expiry(txn, rec.seg, cache) >= now else None)
        return recs

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Leading blocks present and unexpired (binary search, chain_check.py); notes their refresh."""
        return self._check(keys, ttl_s, False).blocks

    def match_explained(self, keys: Sequence[bytes], ttl_s: float) -> Match:
        """`match`, and why keys[blocks] is absent (`_gone`), from the same read snapshot."""
        return self._check(keys, ttl_s, True)

    def _check(self, keys: Sequence[bytes], ttl_s: float, explain: bool) -> Match:
        now = self.clock()
        try:
            with self.index.env.begin() as txn:
                cache: dict[int, float] = {}

                def present(i: int) -> bool:
                    rec = self._live(txn, keys[i], now, cache)
                    return rec is not None and rec.pos == i

                b = leading_present(len(keys), present)
                self.index.touched(len(cache) + 8)
                if b:
                    self._refresh(txn, keys[b - 1], now + ttl_s, now)
                gone = self._gone(txn, keys[b], b, now, cache) if explain and b < len(keys) else None
                return Match(b, gone)
        except lmdb.Error as e:
            log.warning("CHECK on %s failed: %s", self.root, e)
            self.counters.match_failures += 1
            return Match(0)

    def _gone(self, txn: lmdb.Transaction, key: bytes, pos: int, now: float, cache: dict[int, float]) -> Gone | None:
        """Why `key` (at chain position `pos`) is not a live block: its record past its expiry (expired then,
        not yet collected), or its tombstone; None when neither (never stored, or its tombstone dropped)."""
        rec = self.index.block(txn, key)
        if rec is None:
            return self.tombs.find(txn, key)
        expiry = self._expiry(txn, rec.seg, cache)
        return Gone(MissCause.EXPIRED, expiry) if rec.pos == pos and 0 <= expiry < now else None

    def _refresh(self, txn: lmdb.Transaction, tail: bytes, expiry: float, now: float) -> None:
        """Note the refresh of the chain ending at `tail`, unless this process did so under REFRESH_GRAIN_S ago."""
        if self._walked.get(tail, -1.0) >= expiry - REFRESH_GRAIN_S:
            return
        if len(self._walked) > 65536:
            self._walked.clear()
        self._walked[tail] = expiry
        self.refresher.note(self._walk(txn, tail, expiry, now))

    def _walk(self, txn: lmdb.Transaction, key: bytes, expiry: float, now: float) -> dict[int, tuple[float, float]]:
        """Segment id → (expiry, now) for the segments from `key`'s back to its chain's head."""
        out: dict[int, tuple[float, float]] = {}
        while True:
            rec = self.index.block(txn, key)
            if rec is None or rec.seg in out:
                return out
            out[rec.seg] = (expiry, now)
            seg = self.index.seg(txn, rec.seg)
            if seg is None or seg.first_pos == 0:
                return out
            key = seg.head_parent

    def _absent(self, txn: lmdb.Transaction, keys: Sequence[bytes], now: float) -> list[int]:
        """Indices of the keys absent or expired (one C-level lookup of all of them)."""
        with txn.cursor(db=self.index.blocks) as cur:
            found = dict(cur.getmulti(keys))
        if not found:
            return list(range(len(keys)))
        cache: dict[int, float] = {}
        return [i for i, k in enumerate(keys)
                if (raw := found.get(k)) is None or self._expiry(txn, BLOCK.unpack(raw)[0], cache) < now]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        now = self.clock()
        try:
            with self.index.env.begin() as txn:
                cache: dict[int, float] = {}
                self.index.touched(len(keys))
                return [self._live(txn, k, now, cache) is not None for k in keys]
        except lmdb.Error as e:
            log.warning("exists on %s failed: %s", self.root, e)
            return [False] * len(keys)

    # --- write -----------------------------------------------------------------

    def put(self, write: ChainWrite) -> PutResult:
        n = len(write.keys)
        try:
            now = self.clock()
            with self.index.env.begin() as txn:
                sel = self._absent(txn, write.keys, now)
                if write.start_pos > 0:
                    self._refresh(txn, write.parent, now + write.ttl_s, now)
            self.index.touched(n)
            skipped = n - len(sel)
            self.counters.blocks_skipped += skipped
            if not sel:
                return PutResult(0, skipped, 0)
            views = [bytes_view(write.blocks[i]) for i in sel]
            incoming = sum(v.nbytes for v in views)
            if self.capacity_bytes is not None:
                if incoming > self.capacity_bytes:
                    log.warning("put of %d bytes exceeds the store's capacity %d", incoming, self.capacity_bytes)
                    self.counters.put_failures += 1
                    return PutResult(0, skipped, len(sel))
                self.collector.make_room(incoming, now)
            path, rows, file_size = self.writer.write_segment(write, sel, views, now)
            try:
                written = self.writer.index_segment(write, path, rows, file_size, now)
            except lmdb_forget.Held:   # its tenant was forgotten moments ago: a late write (store/forget.py)
                self.unlink([path])
                self.counters.blocks_refused += len(sel)
                return PutResult(0, skipped, len(sel))
            self.index.persist()   # acknowledged only once its index entries are durable
            self.counters.blocks_written += written
            self.counters.blocks_skipped += len(sel) - written
            self.counters.bytes_written += incoming
            return PutResult(written, n - written, 0)
        except (OSError, lmdb.Error) as e:
            log.warning("put of %d blocks to %s failed: %s", n, self.root, e)
            self.counters.put_failures += 1
            return PutResult(0, 0, n)

    def unlink(self, paths: list[str]) -> None:
        """Remove segment files the index no longer names (after the commit that forgot them)."""
        if paths:
            self.index.persist()   # the commit that forgot them is durable before the files go
        for p in paths:
            with suppress(FileNotFoundError):
                os.unlink(self.root / p)

    def _write_refresh(self, batch: dict[int, tuple[float, float]]) -> None:
        """Noted refreshes, REFRESH_TXN segments per write transaction (the lock is free between them)."""
        ids = sorted(batch)
        for i in range(0, len(ids), REFRESH_TXN):
            if i:
                lmdb_gc.pause(0.0)
            with self.index.env.begin(write=True) as w:
                for seg_id in ids[i:i + REFRESH_TXN]:
                    seg = self.index.seg(w, seg_id)
                    if seg is not None:
                        self.index.set_times(w, seg_id, seg, *batch[seg_id])

    # --- read ------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Dest], *, drop: bool = True,
                 on_part: PartDone | None = None) -> list[int]:
        """Read blocks into `bufs` (each at least the block's size); per key its size, or -1 for a miss.
        A block that fails its read is forgotten by the index unless `drop` is false. `on_part`: read part by part
        (`backend.BlockStore.get_into`)."""
        if len(keys) != len(bufs):
            raise ValueError(f"one buffer per key: {len(keys)} keys, {len(bufs)} buffers")
        out = [-1] * len(keys)
        now = self.clock()
        try:
            with self.index.env.begin() as txn:
                cache: dict[int, float] = {}
                recs = self._live_many(txn, keys, now, cache)
                paths = {seg_id: s.path.removeprefix(SEGMENTS) for seg_id in {r.seg for r in recs if r is not None}
                         if (s := self.index.seg(txn, seg_id))}   # once per segment, not once per block
            self.index.touched(len(keys))
        except lmdb.Error as e:
            log.warning("read of %s failed: %s", self.root, e)
            self.counters.misses_absent += len(keys)
            return out
        bad: list[tuple[bytes, BlockRec]] = []
        located: list[tuple[int, Location]] = []
        for i, rec in enumerate(recs):
            if rec is None:
                self.counters.misses_absent += 1
            elif rec.seg not in paths:   # its segment's record went meanwhile: the bytes with it
                self.counters.misses_truncated += 1
                bad.append((keys[i], rec))
            else:
                located.append((i, Location(paths[rec.seg], rec.offset, rec.size, rec.xxh)))
        for (i, _), got in zip(located, self.files.read_blocks(located, bufs, on_part)):
            if isinstance(got, int):
                out[i] = got
                self.counters.blocks_read += 1
                self.counters.bytes_read += got
                continue
            if got == "corrupt":
                self.counters.misses_corrupt += 1
            else:   # short, missing or unreadable: a local store's file is proof enough
                self.counters.misses_truncated += 1
            bad.append((keys[i], recs[i]))  # type: ignore[arg-type]
        if bad and drop:
            lmdb_upkeep.drop_bad(self.tombs, self.unlink, bad, self.clock())
        return out

    def blocks(self) -> Iterator[BlockInfo]:
        """Every live block's metadata (no block byte read), in key order, from one read snapshot."""
        now = self.clock()
        with self.index.env.begin() as txn, txn.cursor(db=self.index.blocks) as cur:
            segs: dict[int, SegRec | None] = {}
            for key, raw in cur:
                rec = BlockRec(*BLOCK.unpack(raw))
                if rec.seg not in segs:
                    segs[rec.seg] = self.index.seg(txn, rec.seg)
                seg = segs[rec.seg]
                if seg is None:
                    continue
                expiry = max(seg.expiry, self.refresher.expiry(rec.seg))
                if expiry >= now:
                    yield BlockInfo(bytes(key), rec.parent, rec.pos, rec.size, seg.created, expiry,
                                    shown_name(seg.namespace), shown_name(seg.ttl_class))

    def refresh(self, force: bool = False) -> None:
        """A no-op: every process reads the one shared index."""

    # --- removal, upkeep, views ------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.collector.delete(keys, self.clock())

    def forget(self, tenant: str, hold_s: float) -> Forgotten:
        """`BlockStore.forget` (lmdb_forget.py)."""
        self.flush()
        return lmdb_forget.forget(self.index, self.tombs, self.unlink, tenant, hold_s, self.clock())

    def gc(self, batch: int = 4096) -> GcResult:
        return self.collector.gc(self.clock(), batch)

    def probe(self) -> str | None:
        return probe_folder(self.root / "segments")

    def stats(self) -> StoreStats:
        self.flush()
        st = StoreStats(self.backend, str(self.root), capacity_bytes=self.capacity_bytes,
                        guarantees=self.quotas.as_dict())
        lmdb_upkeep.fill_stats(self.index, st).counters = self.counters.as_dict()
        return st

    def verify(self, remove: bool = True, orphan_age_s: float = lmdb_upkeep.ORPHAN_AGE_S) -> VerifyResult:
        self.flush()
        def read(keys: list[bytes], bufs: list[bytearray], drop: bool) -> list[int]:
            return self.get_into(keys, bufs, drop=drop)

        return lmdb_upkeep.verify(self.index, self.root, read, self.unlink, remove, orphan_age_s)

    def flush(self) -> None:
        """Write this process's noted TTL refreshes now."""
        self.refresher.flush()

    def close(self) -> None:
        self.refresher.close()
        self.files.close()
        if self.pin is not None:
            self.pin.close()
        self.index.close()

    def __enter__(self) -> LmdbStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
