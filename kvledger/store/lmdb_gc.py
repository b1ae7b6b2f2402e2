"""GC, eviction, deletion and compaction of the LMDB index (`Collector`), in batches, its lock released between them.

Each batch is one write transaction over at most about `batch` blocks (whole segments: a
segment's blocks share its expiry and last hit) and at most BATCH_S of work, so another process's
put waits at most one batch (a CHECK never waits: readers are not blocked by a writer). After
each batch GC pauses as long as the batch held the lock (PAUSE_MIN_S..PAUSE_MAX_S): LMDB's writer
mutex is not fair, and a loop that committed and began again at once would take it back before a
woken waiter runs. Each batch's commit is synced before its files are unlinked, so a crash in
between leaves a file the index does not name (`verify` removes it), never an index entry without
its bytes. Syncing every batch, not every few dozen, bounds how much one sync writes: a batch
dirties ~900 index pages (copy-on-write: leaves, branches, the free list), and another process's
read of an index page the page cache lost queues behind whatever sync is in flight — at 10M blocks
64 batches per sync wrote ~9,000 pages in ~300 ms and stalled such reads as long.

Order: `by_expiry` and `by_hit` sort by (time, highest chain position first), so within one
instant tails go before heads; across instants a head is never older than its tail because a
hit refreshes the whole matched prefix and a put refreshes the chain it extends.

Compaction: a segment whose live bytes fall under COMPACT_BELOW of its data bytes (blocks
deleted or dropped from its middle) is rewritten with its live blocks only, in a new file
fsynced before the transaction that moves the blocks to it; the old file goes after.

Tombstones: every block GC removes is buried (lmdb_tombs.py) in the transaction that removes it: `expired`
at its segment's expiry, or `evicted` at the time of the eviction; so is every block `delete` forgets.

Quotas (quota.py): with guarantees, eviction plans its victims in one read snapshot from the buckets' live
bytes and their own last-hit orders (`quota.pick`: O(buckets + victims), no walk over protected segments),
then removes them in the same bounded batches, each victim only if no hit moved it since the plan. What the
plan cannot free (every owner within its guarantee) goes by plain recency, counted in `quota_overrides`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import lmdb

from kvledger.core.attribution import MissCause
from kvledger.store import quota
from kvledger.store.backend import Counters, GcResult
from kvledger.store.lmdb_index import ORDER, SEG_ID, BlockRec, LmdbIndex, SegRec, order_key
from kvledger.store.lmdb_tombs import Tombstones, tag_of

log = logging.getLogger("kvledger.store")
TXN_BLOCKS = 128    # blocks removed per write transaction at most
BATCH_S = 0.02      # a batch takes no further segment after this long holding the writer lock (s)
PAUSE_MIN_S = 0.001  # the pause after a batch: as long as it held the lock, within these bounds (s)
PAUSE_MAX_S = 0.03
Moved = tuple[str, list[tuple[bytes, BlockRec, int]], int]   # a rewritten segment: path, (key, record, offset), size
Rewrite = Callable[[SegRec, list[tuple[bytes, BlockRec]]], Moved | None]


def pause(held_s: float) -> None:
    """Leave the writer lock free after a batch that held it `held_s` seconds (see the module docstring)."""
    time.sleep(min(max(held_s, PAUSE_MIN_S), PAUSE_MAX_S))



@dataclass(slots=True)
class Collector:
    """GC, eviction, deletion and compaction over one index (see the module docstring). `unlink` removes files
    once the commit that forgot them is durable; `flush` writes this process's noted refreshes (before anything
    is judged expired or least recently hit); `rewrite` copies a segment's live blocks into a new file
    (compaction); `tombs` records what was removed; `where` names the store in logs; `quotas` the guarantees
    eviction keeps (empty: plain recency). Sizes in bytes, times epoch seconds."""

    index: LmdbIndex
    tombs: Tombstones
    unlink: Callable[[list[str]], None]
    flush: Callable[[], None]
    rewrite: Rewrite
    counters: Counters
    capacity_bytes: int | None
    low_watermark: float
    where: str
    quotas: quota.Quotas = field(default_factory=quota.Quotas)

    def _remove_batch(self, order_db: lmdb._Database, stop: Callable[[float, int], bool], batch: int,
                      cause: MissCause, now: float) -> tuple[int, int, int]:
        """One write transaction: remove segments in `order_db` order while `stop(time, bytes so far)` is false,
        about `batch` blocks at most, burying their blocks (`cause`: expired at their segment's expiry, else
        at `now`), then sync it and unlink their files; (segments, blocks, bytes) removed."""
        idx = self.index
        segs = n = nbytes = 0
        paths: list[str] = []
        self._page_in(order_db, stop, batch)
        with idx.env.begin(write=True) as w:
            t0 = time.perf_counter()
            due: list[tuple[bytes, int]] = []
            with w.cursor(db=order_db) as cur:
                for raw in cur.iternext(values=False):
                    ms, _, seg_id = ORDER.unpack(raw)
                    if stop(ms / 1000, nbytes) or n >= batch:
                        break
                    seg = idx.seg(w, seg_id)
                    due.append((raw, seg_id))
                    if seg is not None:
                        n += seg.live
                        nbytes += seg.live_bytes
            n = nbytes = 0
            for raw, seg_id in due:   # removed in order: what the time bound leaves is the next batch's
                if segs and time.perf_counter() - t0 > BATCH_S:
                    break
                seg = idx.seg(w, seg_id)
                if seg is None:
                    w.delete(raw, db=order_db)  # a stray row
                else:
                    keys, got_bytes, path = idx.remove_segment(w, seg_id, seg)
                    n, nbytes = n + len(keys), nbytes + got_bytes
                    paths.append(path)
                    self.tombs.bury(w, keys, cause, seg.expiry if cause is MissCause.EXPIRED else now,
                                    [tag_of(seg.namespace)] * len(keys))
                segs += 1
        if segs:
            held = time.perf_counter() - t0
            self.unlink(paths)
            pause(held)
        return segs, n, nbytes


    def _page_in(self, order_db: lmdb._Database, stop: Callable[[float, int], bool], batch: int) -> None:
        """Touch, in a read snapshot, the index pages the next batch will change: a page the page cache lost is read
        from disk here, outside the writer lock, rather than inside it while every other writer waits."""
        idx = self.index
        n = 0
        with (idx.env.begin() as r, r.cursor(db=order_db) as cur, r.cursor(db=idx.blocks) as blocks,
              r.cursor(db=idx.tombs) as tombs):
            for raw in cur.iternext(values=False):
                ms, _, seg_id = ORDER.unpack(raw)
                if stop(ms / 1000, 0):
                    return
                keys = idx.keys_of(r, seg_id)
                blocks.getmulti(keys)
                tombs.getmulti(keys)
                n += len(keys)
                if n >= batch:
                    return


    def gc(self, now: float, batch: int = 4096) -> GcResult:
        """Remove expired segments (soonest first, tails first), evict down to capacity, compact sparse segments;
        at most TXN_BLOCKS blocks and BATCH_S per transaction whatever `batch` asks (keys are random: each block
        removed dirties about one page, written at the commit while other writers wait)."""
        assert batch > 0
        batch = min(batch, TXN_BLOCKS)
        self.flush()  # this process's noted refreshes first
        expired = evicted = freed = batches = 0
        try:
            while True:
                segs, n, nb = self._remove_batch(self.index.by_expiry, lambda t, _: t >= now, batch,
                                                 MissCause.EXPIRED, now)
                if segs == 0:
                    break
                expired += n
                freed += nb
                batches += 1
            if self.capacity_bytes is not None:
                n, nb, b = self.evict(self._live_bytes() - int(self.capacity_bytes * self.low_watermark), now, batch)
                evicted, freed, batches = n, freed + nb, batches + b
            batches += self.compact(batch)
        except (OSError, lmdb.Error) as e:
            log.warning("gc of %s stopped: %s", self.where, e)
        self.counters.gc_expired += expired
        self.counters.gc_evicted += evicted
        return GcResult(expired, evicted, freed, batches)


    def _live_bytes(self) -> int:
        with self.index.env.begin() as txn:
            return self.index.total(txn, b"live_bytes")


    def evict(self, need_bytes: int, now: float, batch: int = 4096) -> tuple[int, int, int]:
        """Free `need_bytes`, burying what goes as evicted at `now`: least recently hit first (tails first), and with
        quotas only from owners above their guarantee while any is (the module docstring); (blocks, bytes,
        batches)."""
        if not self.quotas:
            return self._evict_by_hit(need_bytes, now, batch)
        n, nbytes, batches = self._evict_by_quota(need_bytes, now, batch)
        if nbytes < need_bytes:
            more, more_bytes, b = self._evict_by_hit(need_bytes - nbytes, now, batch)
            if more:
                log.warning("%s: every namespace is within its guarantee and the store is still over capacity "
                            "(guarantees over-subscribed): %d blocks (%d bytes) evicted by recency alone",
                            self.where, more, more_bytes)
                self.counters.quota_overrides += more
            n, nbytes, batches = n + more, nbytes + more_bytes, batches + b
        return n, nbytes, batches

    def _evict_by_quota(self, need_bytes: int, now: float, batch: int) -> tuple[int, int, int]:
        """`quota.pick`'s victims, planned and removed until `need_bytes` are freed or the plan is empty."""
        n = nbytes = batches = 0
        while nbytes < need_bytes:
            with self.index.env.begin() as r:
                usage = self.index.usage(r)
                streams = {bid: self._candidates(r, bid) for bid in usage}
                picked = quota.pick(self.quotas, usage, streams, need_bytes - nbytes)
            if not picked.victims:
                break
            got, got_bytes, b = self._remove_listed([c.handle for _, c in picked.victims], batch, now)
            if got_bytes == 0:
                break   # every victim was hit (or removed) since the plan
            n, nbytes, batches = n + got, nbytes + got_bytes, batches + b
        return n, nbytes, batches

    def _candidates(self, txn: lmdb.Transaction, bid: bytes) -> Iterator[quota.Candidate]:
        """A bucket's segments as eviction candidates, least recently hit first (read lazily: `pick` stops early)."""
        for raw, seg_id in self.index.bucket_order(txn, bid):
            seg = self.index.seg(txn, seg_id)
            if seg is not None:
                yield quota.Candidate(raw, seg.live_bytes, (seg_id, raw))

    def _remove_listed(self, victims: list[tuple[int, bytes]], batch: int, now: float) -> tuple[int, int, int]:
        """Remove the planned segments (segment id, its order key at the plan) in transactions of about `batch`
        blocks and at most BATCH_S each, skipping one hit or removed since; (blocks, bytes, batches)."""
        n = nbytes = batches = 0
        i = 0
        while i < len(victims):
            paths: list[str] = []
            with self.index.env.begin(write=True) as w:
                t0 = time.perf_counter()
                blocks = 0
                while i < len(victims) and blocks < batch and (blocks == 0 or time.perf_counter() - t0 <= BATCH_S):
                    seg_id, planned = victims[i]
                    i += 1
                    seg = self.index.seg(w, seg_id)
                    if seg is None or order_key(seg.last_hit, seg.first_pos, seg_id) != planned:
                        continue
                    keys, got_bytes, path = self.index.remove_segment(w, seg_id, seg)
                    self.tombs.bury(w, keys, MissCause.EVICTED, now, [tag_of(seg.namespace)] * len(keys))
                    paths.append(path)
                    blocks += len(keys)
                    n, nbytes = n + len(keys), nbytes + got_bytes
            held = time.perf_counter() - t0
            self.unlink(paths)
            batches += 1
            pause(held)
        return n, nbytes, batches

    def _evict_by_hit(self, need_bytes: int, now: float, batch: int) -> tuple[int, int, int]:
        """Remove least recently hit segments (tails first), whoever holds them, until `need_bytes` are freed."""
        n = nbytes = batches = 0
        batch = min(batch, TXN_BLOCKS)
        while nbytes < need_bytes:
            left = need_bytes - nbytes
            segs, got, got_bytes = self._remove_batch(self.index.by_hit, lambda _, freed, left=left: freed >= left,
                                                      batch, MissCause.EVICTED, now)
            if segs == 0:
                break
            n, nbytes, batches = n + got, nbytes + got_bytes, batches + 1
        return n, nbytes, batches


    def make_room(self, incoming: int, now: float) -> None:
        """Before a put of `incoming` bytes at `now`: evict down to the low watermark if the put would pass
        capacity."""
        cap = self.capacity_bytes
        assert cap is not None
        live = self._live_bytes()
        if live + incoming > cap:
            self.flush()  # this process's noted hits count before anything is judged least recently hit
            target = max(int(cap * self.low_watermark) - incoming, 0)
            n = self.evict(live - target, now)[0]
            self.counters.gc_evicted += n


    def delete(self, keys: Sequence[bytes], now: float) -> int:
        """Forget these blocks (one transaction), burying them as evicted at `now`; files left empty are unlinked,
        sparse ones compacted by gc."""
        from kvledger.store.lmdb_write import COMPACT_BELOW

        idx = self.index
        paths = []
        gone, tags = [], []
        try:
            with idx.env.begin(write=True) as w:
                for k in keys:
                    rec = idx.block(w, k)
                    if rec is not None:
                        tags += self.tombs.tags_of(w, [rec])
                        paths.append(idx.drop_block(w, k, rec, COMPACT_BELOW))
                        gone.append(k)
                self.tombs.bury(w, gone, MissCause.EVICTED, now, tags)
        except lmdb.Error as e:
            log.warning("delete on %s failed: %s", self.where, e)
            return 0
        self.unlink([p for p in paths if p])
        return len(gone)


    def compact(self, batch: int = 4096, most: int = 100_000) -> int:
        """Rewrite the segments marked sparse (at most `most` per call, each once), about `batch` blocks between
        pauses; the number of batches."""
        with self.index.env.begin() as txn, txn.cursor(db=self.index.sparse) as cur:
            ids = [SEG_ID.unpack(k)[0] for k in itertools.islice(cur.iternext(values=False), most)]
        batches = done = 0
        for seg_id in ids:   # each segment is its own transaction, its copy made before, outside it
            done += self._compact_one(seg_id)
            if done >= batch:
                batches, done = batches + 1, 0
        return batches + (1 if done else 0)


    def _compact_one(self, seg_id: int) -> int:
        """Move the live blocks of one segment into a new file; blocks moved."""
        idx = self.index
        with idx.env.begin() as txn:
            seg = idx.seg(txn, seg_id)
            keys = idx.keys_of(txn, seg_id)
            live = [(k, r) for i, k in enumerate(keys) if (r := idx.block(txn, k)) and r.seg == seg_id and r.idx == i]
        if seg is None or not live:
            with idx.env.begin(write=True) as w:
                w.delete(SEG_ID.pack(seg_id), db=idx.sparse)
            return 0
        new = self.rewrite(seg, live)
        if new is None:
            return 0
        path, rows, file_size = new
        moved = self._move_blocks(seg_id, seg, path, rows, file_size)
        return moved


    def _move_blocks(self, old_id: int, old: SegRec, path: str, rows: list[tuple[bytes, BlockRec, int]],
                     file_size: int) -> int:
        """One transaction: the blocks still in the old segment point to the new one; the old one is forgotten."""
        idx = self.index
        unlink = []
        with idx.env.begin(write=True) as w:
            t0 = time.perf_counter()
            cur = idx.seg(w, old_id)
            if cur is None:
                unlink.append(path)  # removed meanwhile: the new file is not needed
            else:
                new = SegRec(cur.expiry, cur.last_hit, cur.created, cur.ttl_s, rows[0][1].pos, len(rows), 0, 0,
                             sum(r.size for _, r, _ in rows), file_size, rows[0][1].parent, cur.namespace,
                             cur.ttl_class, path)
                new_id = idx.add_segment(w, new, [k for k, _, _ in rows])
                for i, (key, rec, off) in enumerate(rows):
                    now_rec = idx.block(w, key)
                    if now_rec is None or now_rec.seg != old_id or now_rec.idx != rec.idx:
                        continue
                    idx.add_block(w, key, now_rec._replace(seg=new_id, idx=i, offset=off))
                    new.live += 1
                    new.live_bytes += rec.size
                idx.put_seg(w, new_id, new)
                unlink.append(idx.remove_segment(w, old_id, cur)[2])   # holds no block now
                if new.live == 0:
                    unlink.append(idx.remove_segment(w, new_id, new)[2])
        pause(time.perf_counter() - t0)
        self.unlink(unlink)
        return len(rows)
