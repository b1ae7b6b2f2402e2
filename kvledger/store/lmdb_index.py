"""The persisted block index: one LMDB environment per store directory, shared by every process of the node.

LMDB is a memory-mapped B+tree with MVCC: readers never wait (a read transaction is a snapshot),
one writer at a time (its lock lives in `lock.mdb`, held only for the length of a write
transaction), opening is O(1) and a process's memory holds only the pages it touches.

    DIR/index.lmdb/data.mdb, lock.mdb
    blocks     key (16 B) → BlockRec (52 B): segment id, entry index, chain position, size, xxh3-64, offset, parent
    segs       segment id (u64 BE) → SegRec: expiry, last hit, created, TTL, first position, entries, live
               count and bytes, file bytes, the parent key of its first block, namespace, class, relative path
    seg_keys   segment id → the keys of its entries, 16 B each (GC removes a segment without reading its file)
    by_expiry  (expiry ms, ~first position, segment id) → ''   GC order: soonest first, tails first on ties
    by_hit     (last hit ms, ~first position, segment id) → ''  eviction order: least recently hit, tails first
    sparse     segment id → ''                                  live share under the compaction threshold
    paths      relative path → segment id                       verify: files the index does not know
    meta       name → u64                                       totals, next segment id, format, the holds of
                                                                forgotten tenants (lmdb_forget.py)
    tombs, tomb_order                                           removed blocks: when and why (lmdb_tombs.py)
    buckets    bucket id (8 B) → live bytes (i64) + its names   per (tenant namespace, class): quota.py
    by_bucket_hit  (bucket id, last hit ms, ~first pos, seg id) → ''  each bucket's eviction order

Expiry and last hit are per segment (the blocks of one put): a CHECK hit refreshes the few
segments of the prefix it matched, never one record per block.

Invariants, kept by every write transaction: a block record names a segment record whose
`seg_keys[idx]` is that key; `live` / `live_bytes` of a segment count the block records naming
it; the totals in `meta` are the sums over the segments, and a bucket's live bytes the sum over the segments
of that bucket (`quota.bucket_of` their namespace and class): both change in the transaction that adds or
removes a block (`add_live`, `drop_block`, `remove_segment`); every segment has one row in
`by_expiry`, one in `by_hit` and one in `by_bucket_hit`. A segment's file is whole and fsynced before its record is
committed, so a block is in the index only once its bytes are durable.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvledger.store.map_trim import MapTrim
from kvledger.store.quota import Bucket, bucket_and_id
from kvledger.util.private_file import private_dir, tighten

INDEX_DIR = "index.lmdb"   # the index's folder under a store's root
DATA_FILE = "data.mdb"     # LMDB's one data file in it: what MapTrim trims and IndexPin pins
LOCK_FILE = "lock.mdb"     # LMDB's lock file beside it (readers' table)


def data_file(root: Path) -> Path:
    """The index's data file of the store at `root`."""
    return root / INDEX_DIR / DATA_FILE

FORMAT = 2                    # 1 = segment files only (the previous design), 2 = this index
MAP_SIZE = 1 << 40            # address space reserved for the index (sparse: the file grows as needed)
BLOCK = struct.Struct("<QIIIQQ16s")   # seg, idx, pos, size, xxh, offset, parent
SEG = struct.Struct("<ddddIIIQQQ16sHHH")  # expiry, last_hit, created, ttl_s, first_pos, n, live, live_bytes,
#                                          data_bytes, file_size, head_parent, ns_len, cls_len, path_len
ORDER = struct.Struct(">QIQ")         # time ms, ~first_pos, seg id: big-endian so LMDB sorts it
SEG_ID = struct.Struct(">Q")
U64 = struct.Struct("<q")
BLOCK_TAIL = struct.Struct("<IIIQQ16s")  # BLOCK without its segment id: packed before the write transaction
SEG_LE = struct.Struct("<Q")              # ... which prefixes it inside
assert BLOCK.size == 52 and SEG_LE.size + BLOCK_TAIL.size == BLOCK.size
BUCKETS_BUILT = b"buckets"   # meta: set once the bucket totals and order cover every segment (`build_buckets`)


class BlockRec(NamedTuple):
    seg: int
    idx: int
    pos: int       # chain position (0 = first block of a prompt)
    size: int
    xxh: int
    offset: int    # byte offset of the block in its segment file
    parent: bytes


@dataclass(slots=True)
class SegRec:
    """A segment as the index knows it (times epoch seconds, sizes bytes)."""

    expiry: float
    last_hit: float
    created: float
    ttl_s: float
    first_pos: int
    n: int
    live: int
    live_bytes: int
    data_bytes: int
    file_size: int
    head_parent: bytes   # parent key of its first entry: the walk to the chain's head goes through it
    namespace: bytes
    ttl_class: bytes
    path: str            # relative to the store's root

    def pack(self) -> bytes:
        p = self.path.encode()
        head = SEG.pack(self.expiry, self.last_hit, self.created, self.ttl_s, self.first_pos, self.n, self.live,
                        self.live_bytes, self.data_bytes, self.file_size, self.head_parent, len(self.namespace),
                        len(self.ttl_class), len(p))
        return head + self.namespace + self.ttl_class + p

    @classmethod
    def unpack(cls, raw: bytes) -> SegRec:
        *nums, ns_len, cls_len, path_len = SEG.unpack_from(raw)
        o = SEG.size
        ns, cl = raw[o:o + ns_len], raw[o + ns_len:o + ns_len + cls_len]
        path = raw[o + ns_len + cls_len:o + ns_len + cls_len + path_len].decode()
        return cls(*nums, ns, cl, path)


def _open_dbs(env: lmdb.Environment) -> dict[bytes, lmdb._Database]:
    """The named databases, in one transaction (LMDB opens a name under its writer lock: an open waits for at
    most the one write transaction in progress, never for a GC run, which commits in small batches)."""
    names = (b"blocks", b"segs", b"seg_keys", b"by_expiry", b"by_hit", b"sparse", b"paths", b"meta", b"tombs",
             b"tomb_order", b"buckets", b"by_bucket_hit")
    with env.begin(write=True) as txn:
        return {n: env.open_db(n, txn=txn) for n in names}


def order_key(t: float, first_pos: int, seg_id: int) -> bytes:
    return ORDER.pack(max(int(t * 1000), 0), 0xFFFFFFFF - min(first_pos, 0xFFFFFFFF), seg_id)


class _SharedEnv(NamedTuple):
    env: lmdb.Environment
    dbs: dict[bytes, lmdb._Database]
    trim: MapTrim


# LMDB refuses a second open of one environment in one process ("already open in this process"), and two
# stores on one directory in one process are normal (the vLLM connector's scheduler and worker sides, an
# entrypoint and an engine): they share the environment, which closes with its last user.
_SHARED: dict[str, _SharedEnv] = {}
_USERS: dict[str, int] = {}
_SHARED_LOCK = threading.Lock()


def _make_private(folder: Path) -> None:
    """LMDB's two files exactly 0600 whatever the umask (DESIGN: the index names every salted namespace): LMDB
    creates them with `mode` less the umask, which may take the owner's own bits; an older store's 0644 ones
    this user owns are tightened too."""
    for name in (DATA_FILE, LOCK_FILE):
        tighten(folder / name)


class LmdbIndex:
    """The named databases of one environment and the few write operations that keep the invariants.

    Every `LmdbIndex` of one path in one process shares one environment (see `_SHARED`)."""

    def __init__(self, path: Path, *, sync: bool = True) -> None:
        """`sync`: `persist()` fdatasyncs the index. Commits themselves do not sync, so no writer holds the lock
        through an fsync (on this machine one fsync takes up to a quarter of a second under load); the store
        persists after a put's commit and before it returns, and before it unlinks what a commit forgot."""
        private_dir(path)
        self.durable = sync
        self._name: str | None = os.path.realpath(path)
        with _SHARED_LOCK:
            shared = _SHARED.get(self._name)
            if shared is None:
                env = lmdb.open(self._name, map_size=MAP_SIZE, max_dbs=16, sync=False, metasync=False,
                                readahead=False, max_readers=1024, mode=0o600)
                _make_private(Path(self._name))
                trim = MapTrim(os.path.join(self._name, DATA_FILE))
                shared = _SHARED[self._name] = _SharedEnv(env, _open_dbs(env), trim)
            _USERS[self._name] = _USERS.get(self._name, 0) + 1
        self.env, dbs, trim = shared
        self._trim: MapTrim | None = trim
        self.blocks, self.segs, self.seg_keys = dbs[b"blocks"], dbs[b"segs"], dbs[b"seg_keys"]
        self.by_expiry, self.by_hit, self.sparse = dbs[b"by_expiry"], dbs[b"by_hit"], dbs[b"sparse"]
        self.paths, self.meta = dbs[b"paths"], dbs[b"meta"]
        self.tombs, self.tomb_order = dbs[b"tombs"], dbs[b"tomb_order"]
        self.buckets, self.by_bucket_hit = dbs[b"buckets"], dbs[b"by_bucket_hit"]

    def persist(self) -> None:
        """Make every commit so far durable (all processes': it syncs the file), outside any transaction."""
        if self.durable:
            self.env.sync(True)

    def touched(self, n: int) -> None:
        """`n` keys were looked up: bounds the map's share of this process's RSS (map_trim.py)."""
        trim = self._trim
        if trim is not None:
            trim.touched(n)

    def close(self) -> None:
        """Idempotent; the shared environment closes with its last user in this process."""
        self._trim = None
        with _SHARED_LOCK:
            name, self._name = self._name, None
            if name is None:
                return
            _USERS[name] -= 1
            if _USERS[name] == 0:
                del _USERS[name]
                shared = _SHARED.pop(name)
                shared.trim.close()
                shared.env.close()

    # --- reads (any transaction) --------------------------------------------------

    def block(self, txn: lmdb.Transaction, key: bytes) -> BlockRec | None:
        raw = txn.get(key, db=self.blocks)
        return None if raw is None else BlockRec(*BLOCK.unpack(raw))

    def seg(self, txn: lmdb.Transaction, seg_id: int) -> SegRec | None:
        raw = txn.get(SEG_ID.pack(seg_id), db=self.segs)
        return None if raw is None else SegRec.unpack(raw)

    def keys_of(self, txn: lmdb.Transaction, seg_id: int) -> list[bytes]:
        raw = txn.get(SEG_ID.pack(seg_id), db=self.seg_keys) or b""
        return [raw[i:i + 16] for i in range(0, len(raw), 16)]

    def total(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self.meta)
        return 0 if raw is None else U64.unpack(raw)[0]

    def usage(self, txn: lmdb.Transaction) -> dict[bytes, tuple[Bucket, int]]:
        """Every bucket's live bytes: id → (bucket, bytes); one row per (tenant namespace, class) ever stored."""
        with txn.cursor(db=self.buckets) as cur:
            return {bytes(k): (Bucket.unpack(v[8:]), U64.unpack_from(v)[0]) for k, v in cur}

    def bucket_order(self, txn: lmdb.Transaction, bid: bytes) -> Iterator[tuple[bytes, int]]:
        """(order key, segment id) of the bucket's segments, least recently hit first (tails first on ties)."""
        with txn.cursor(db=self.by_bucket_hit) as cur:
            if not cur.set_range(bid):
                return
            for raw in cur.iternext(values=False):
                if raw[:len(bid)] != bid:
                    return
                yield raw[len(bid):], ORDER.unpack_from(raw, len(bid))[2]

    def first_due(self, txn: lmdb.Transaction, order_db: lmdb._Database) -> tuple[float, int] | None:
        """(time s, segment id) of the first row of an order table, or None when it is empty."""
        with txn.cursor(db=order_db) as cur:
            if not cur.first():
                return None
            ms, _, seg_id = ORDER.unpack(cur.key())
            return ms / 1000, seg_id

    # --- writes (a write transaction) ----------------------------------------------

    def bump(self, w: lmdb.Transaction, name: bytes, delta: int) -> None:
        if delta:
            w.put(name, U64.pack(self.total(w, name) + delta), db=self.meta)

    def new_seg_id(self, w: lmdb.Transaction) -> int:
        seg_id = self.total(w, b"next_seg") + 1
        w.put(b"next_seg", U64.pack(seg_id), db=self.meta)
        return seg_id

    def bump_many(self, w: lmdb.Transaction, deltas: dict[bytes, int]) -> None:
        for name, delta in deltas.items():
            self.bump(w, name, delta)

    def add_live(self, w: lmdb.Transaction, seg: SegRec, blocks: int, nbytes: int) -> None:
        """`blocks` blocks of `nbytes` bytes of segment `seg` became live (negative: went): the totals and the
        segment's bucket (the caller keeps `seg.live` / `seg.live_bytes`)."""
        self.bump(w, b"blocks", blocks)
        self.bump(w, b"live_bytes", nbytes)
        self.bump_bucket(w, seg, nbytes)

    def bump_bucket(self, w: lmdb.Transaction, seg: SegRec, nbytes: int) -> None:
        """Add `nbytes` (negative: remove) to the live bytes of `seg`'s bucket; a bucket left empty loses its row."""
        if not nbytes:
            return
        bid, bucket = bucket_and_id(seg.namespace, seg.ttl_class)
        raw = w.get(bid, db=self.buckets)
        held = (U64.unpack_from(raw)[0] if raw is not None else 0) + nbytes
        assert held >= 0, f"bucket {bucket} would hold {held} bytes"
        if held:
            w.put(bid, U64.pack(held) + bucket.pack(), db=self.buckets)
        else:
            w.delete(bid, db=self.buckets)

    def add_bucket_row(self, w: lmdb.Transaction, seg_id: int, seg: SegRec) -> None:
        """The segment's row in its bucket's eviction order (`record_segment` writes it; `build_buckets` too)."""
        w.put(self._bucket_row(seg, seg.last_hit, seg_id), b"", db=self.by_bucket_hit)

    def add_segment(self, w: lmdb.Transaction, seg: SegRec, keys: list[bytes]) -> int:
        """Record a segment (its blocks are added with `add_block`); its id."""
        seg_id = self.new_seg_id(w)
        self.record_segment(w, seg_id, seg, keys)
        self.bump(w, b"segments", 1)
        self.bump(w, b"disk_bytes", seg.file_size)
        return seg_id

    def record_segment(self, w: lmdb.Transaction, seg_id: int, seg: SegRec, keys: list[bytes]) -> None:
        """The rows of segment `seg_id` (its record, keys, order rows, path); the totals are the caller's."""
        sid = SEG_ID.pack(seg_id)
        w.put(sid, seg.pack(), db=self.segs)
        w.put(sid, b"".join(keys), db=self.seg_keys)
        w.put(order_key(seg.expiry, seg.first_pos, seg_id), b"", db=self.by_expiry)
        w.put(order_key(seg.last_hit, seg.first_pos, seg_id), b"", db=self.by_hit)
        self.add_bucket_row(w, seg_id, seg)
        w.put(seg.path.encode(), sid, db=self.paths)

    @staticmethod
    def _bucket_row(seg: SegRec, last_hit: float, seg_id: int) -> bytes:
        return bucket_and_id(seg.namespace, seg.ttl_class)[0] + order_key(last_hit, seg.first_pos, seg_id)

    def put_seg(self, w: lmdb.Transaction, seg_id: int, seg: SegRec) -> None:
        w.put(SEG_ID.pack(seg_id), seg.pack(), db=self.segs)

    def set_times(self, w: lmdb.Transaction, seg_id: int, seg: SegRec, expiry: float, last_hit: float) -> None:
        """Move a segment's expiry and last hit forward (never back)."""
        expiry, last_hit = max(seg.expiry, expiry), max(seg.last_hit, last_hit)
        if expiry == seg.expiry and last_hit == seg.last_hit:
            return
        w.delete(order_key(seg.expiry, seg.first_pos, seg_id), db=self.by_expiry)
        w.delete(order_key(seg.last_hit, seg.first_pos, seg_id), db=self.by_hit)
        if last_hit != seg.last_hit:
            w.delete(self._bucket_row(seg, seg.last_hit, seg_id), db=self.by_bucket_hit)
            w.put(self._bucket_row(seg, last_hit, seg_id), b"", db=self.by_bucket_hit)
        seg.expiry, seg.last_hit = expiry, last_hit
        w.put(order_key(expiry, seg.first_pos, seg_id), b"", db=self.by_expiry)
        w.put(order_key(last_hit, seg.first_pos, seg_id), b"", db=self.by_hit)
        self.put_seg(w, seg_id, seg)

    def add_block(self, w: lmdb.Transaction, key: bytes, rec: BlockRec) -> None:
        """Index a block of a segment already recorded (the caller has dropped any older record of the key, and
        adds the block to the totals `blocks` and `live_bytes` once per transaction)."""
        w.put(key, BLOCK.pack(*rec), db=self.blocks)

    def drop_block(self, w: lmdb.Transaction, key: bytes, rec: BlockRec, sparse_below: float) -> str | None:
        """Forget one block; the path of its segment when that segment is now empty (removed: unlink it)."""
        w.delete(key, db=self.blocks)
        seg = self.seg(w, rec.seg)
        if seg is None:   # (never, by the invariants) its bucket unknown: the totals alone
            self.bump(w, b"blocks", -1)
            self.bump(w, b"live_bytes", -rec.size)
            return None
        self.add_live(w, seg, -1, -rec.size)
        seg.live -= 1
        seg.live_bytes -= rec.size
        if seg.live <= 0:
            return self.remove_segment(w, rec.seg, seg)[2]
        self.put_seg(w, rec.seg, seg)
        if seg.live_bytes < sparse_below * seg.data_bytes:
            w.put(SEG_ID.pack(rec.seg), b"", db=self.sparse)
        return None

    def remove_segment(self, w: lmdb.Transaction, seg_id: int, seg: SegRec) -> tuple[list[bytes], int, str]:
        """Forget a segment and every block it still holds: (their keys, their bytes, path to unlink)."""
        sid = SEG_ID.pack(seg_id)
        gone: list[bytes] = []
        nbytes = 0
        for idx, key in enumerate(self.keys_of(w, seg_id)):
            rec = self.block(w, key)
            if rec is not None and rec.seg == seg_id and rec.idx == idx:
                w.delete(key, db=self.blocks)
                gone.append(key)
                nbytes += rec.size
        self.add_live(w, seg, -len(gone), -nbytes)
        self.bump(w, b"segments", -1)
        self.bump(w, b"disk_bytes", -seg.file_size)
        for db in (self.segs, self.seg_keys, self.sparse):
            w.delete(sid, db=db)
        w.delete(order_key(seg.expiry, seg.first_pos, seg_id), db=self.by_expiry)
        w.delete(order_key(seg.last_hit, seg.first_pos, seg_id), db=self.by_hit)
        w.delete(self._bucket_row(seg, seg.last_hit, seg_id), db=self.by_bucket_hit)
        w.delete(seg.path.encode(), db=self.paths)
        return gone, nbytes, seg.path
