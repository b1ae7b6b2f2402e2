"""The tombstones of the LMDB index: key → when and why GC, a damaged read or `delete` removed a block; bounded.

    tombs       key (16 B) → TOMB (17 B): sequence number, time (epoch s), cause (1 expired, 2 evicted)
    tomb_order  sequence number (u64 BE) → key: burial order, oldest first

Invariants, kept by every write transaction: the two tables are in one-to-one correspondence (each
tomb's sequence number names its order row, which names it back), and they hold at most `cap` rows:
a burial past the cap drops the oldest tombstones. A key buried again keeps only its latest tombstone.

Size at the cap (DEFAULT_CAP = 1,000,000): about 100 B a tombstone in the index file (the `tombs` B-tree of
random keys, pages partly filled, 41 B a node; the `tomb_order` rows appended in order, 32 B a node, full
pages): 101 MB measured at the cap, paged in only where a CHECK or a GC touches it
(tests/store/test_tombstones.py::test_tombstone_bytes_at_scale checks the figure at 20,000: 105 B).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

from kvledger.core.attribution import MissCause
from kvledger.store.backend import Gone
from kvledger.store.lmdb_index import SEG_ID, U64, LmdbIndex

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

    def bury(self, w: lmdb.Transaction, keys: Sequence[bytes], cause: MissCause, at: float) -> None:
        """In the write transaction `w`: a tombstone (at, cause) for each key, then the oldest dropped past the cap.
        Both tables take their rows in one C-level insert each; only keys buried before are looked at one by one."""
        if not keys:
            return
        idx = self.index
        seq = idx.total(w, NEXT)
        code = CAUSE_CODE[cause]
        rows = [(k, TOMB.pack(seq + i, at, code)) for i, k in enumerate(keys)]
        with w.cursor(db=idx.tombs) as cur:
            _, added = cur.putmulti(rows, overwrite=False)
        if added < len(rows):   # buried before: the latest tombstone replaces the old one and its order row
            for k, v in rows:
                old = w.get(k, db=idx.tombs)
                if old != v:
                    w.delete(SEG_ID.pack(TOMB.unpack(old)[0]), db=idx.tomb_order)
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
        _, at, code = TOMB.unpack(raw)
        cause = CODE_CAUSE.get(code)
        return None if cause is None else Gone(cause, at)

    def count(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self.index.tombs)["entries"]
