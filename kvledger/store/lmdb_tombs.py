"""The tombstones of the LMDB index: key → when and why GC, a damaged read or `delete` removed a block; bounded.

    tombs       key (16 B) → TOMB (17 B): sequence number, time (epoch s), cause (1 expired, 2 evicted), then the
                tenant tag of the block's namespace (8 B, store/forget.py; absent in tombstones older than tags)
    tomb_order  sequence number (u64 BE) → key: burial order, oldest first

Invariants, kept by every write transaction: the two tables are in one-to-one correspondence (each
tomb's sequence number names its order row, which names it back), and they hold at most `cap` rows:
a burial past the cap drops the oldest tombstones. A key buried again keeps only its latest tombstone.

A forget removes a tenant's tombstones by their tag (`of_tenant`, `remove`), both rows of each.

Size at the cap (DEFAULT_CAP = 1,000,000): about 115 B a tombstone in the index file (the `tombs` B-tree of
random keys, pages partly filled, 49 B a node with the tag; the `tomb_order` rows appended in order, 32 B a node,
full pages): 101 MB measured at the cap before tombstones carried their tag, about 113 MB with it (scaled from
20,000 tombstones, where tests/store/test_tombstones.py::test_tombstone_bytes_at_scale measures 114 B each, 102 B
without the tag), paged in only where a CHECK or a GC touches it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

from kvledger.core.attribution import MissCause
from kvledger.store.backend import Gone, shown_name
from kvledger.store.forget import TAG_BYTES, tenant_tag
from kvledger.store.lmdb_index import SEG_ID, U64, BlockRec, LmdbIndex

TOMB = struct.Struct("<QdB")   # sequence number, time (epoch s), cause code
CAUSE_CODE = {MissCause.EXPIRED: 1, MissCause.EVICTED: 2}
CODE_CAUSE = {v: k for k, v in CAUSE_CODE.items()}
DEFAULT_CAP = 1_000_000        # tombstones kept at most (oldest dropped)
NEXT = b"next_tomb"            # the `meta` row of the next sequence number


@dataclass(slots=True)
class Tombstones:
    """The tombstone tables of `index`, holding at most `cap` tombstones (see the module docstring)."""

    index: LmdbIndex
    cap: int = DEFAULT_CAP

    def __post_init__(self) -> None:
        assert self.cap >= 0

    def bury(self, w: lmdb.Transaction, keys: Sequence[bytes], cause: MissCause, at: float,
             tags: Sequence[bytes]) -> None:
        """In the write transaction `w`: a tombstone (at, cause, tag) for each key (`tags[i]`: the tenant tag of
        key i's namespace, `tag_of`), then the oldest dropped past the cap. Both tables take their rows in one
        C-level insert each; only keys buried before are looked at one by one."""
        if not keys:
            return
        assert len(tags) == len(keys)
        idx = self.index
        seq = idx.total(w, NEXT)
        code = CAUSE_CODE[cause]
        rows = [(k, TOMB.pack(seq + i, at, code) + tag) for i, (k, tag) in enumerate(zip(keys, tags))]
        with w.cursor(db=idx.tombs) as cur:
            _, added = cur.putmulti(rows, overwrite=False)
        if added < len(rows):   # buried before: the latest tombstone replaces the old one and its order row
            for k, v in rows:
                old = w.get(k, db=idx.tombs)
                if old != v:
                    w.delete(SEG_ID.pack(TOMB.unpack_from(old)[0]), db=idx.tomb_order)
                    w.put(k, v, db=idx.tombs)
        with w.cursor(db=idx.tomb_order) as cur:   # sequence numbers only grow: appended
            cur.putmulti([(SEG_ID.pack(seq + i), k) for i, k in enumerate(keys)], append=True)
        w.put(NEXT, U64.pack(seq + len(keys)), db=idx.meta)
        self._trim(w)

    def _trim(self, w: lmdb.Transaction) -> None:
        idx = self.index
        extra = w.stat(idx.tomb_order)["entries"] - self.cap
        if extra <= 0:
            return
        with w.cursor(db=idx.tomb_order) as cur:
            cur.first()
            for _ in range(extra):
                w.delete(cur.value(), db=idx.tombs)
                cur.delete()   # moves to the next row

    def find(self, txn: lmdb.Transaction, key: bytes) -> Gone | None:
        """The tombstone of `key`, or None."""
        raw = txn.get(key, db=self.index.tombs)
        if raw is None:
            return None
        _, at, code = TOMB.unpack_from(raw)
        cause = CODE_CAUSE.get(code)
        return None if cause is None else Gone(cause, at)

    def count(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self.index.tombs)["entries"]

    def tags_of(self, txn: lmdb.Transaction, recs: Sequence[BlockRec]) -> list[bytes]:
        """The tenant tag of each block's namespace (from its segment's record; b"" when that is gone), read before
        the blocks are dropped."""
        tags: dict[int, bytes] = {}
        for rec in recs:
            if rec.seg not in tags:
                seg = self.index.seg(txn, rec.seg)
                tags[rec.seg] = b"" if seg is None else tag_of(seg.namespace)
        return [tags[rec.seg] for rec in recs]

    def of_tenant(self, txn: lmdb.Transaction, tag: bytes) -> list[bytes]:
        """The keys whose tombstone carries `tag` (a scan of the tombstones: a forget's, not a CHECK's)."""
        assert len(tag) == TAG_BYTES
        with txn.cursor(db=self.index.tombs) as cur:
            return [bytes(k) for k, v in cur if v[TOMB.size:] == tag]

    def remove(self, w: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        """In `w`: drop the tombstones of `keys` (both rows of each); how many there were."""
        idx, n = self.index, 0
        for k in keys:
            raw = w.get(k, db=idx.tombs)
            if raw is not None:
                w.delete(SEG_ID.pack(TOMB.unpack_from(raw)[0]), db=idx.tomb_order)
                w.delete(k, db=idx.tombs)
                n += 1
        return n


def tag_of(stored_namespace: bytes) -> bytes:
    """The tenant tag of a namespace as the index stores it (`backend.stored_name`)."""
    return tenant_tag(shown_name(stored_namespace))
