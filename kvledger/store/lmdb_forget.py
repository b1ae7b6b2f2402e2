"""Forgetting a tenant in an LMDB index (store/forget.py): its hold, its segments, its tombstones.

    meta    b"hold:" + tenant tag (8 B) → U64: until when (epoch ms) the tenant's puts are refused

Order, each step a transaction of its own: (1) the hold is written; (2) one read snapshot lists the tenant's
segments (those whose recorded namespace is one of its) and its tombstones (by tag); (3) they are removed in
batches of about TXN_BLOCKS blocks, the writer lock released between batches as GC does. A put indexed before
(1) is in the snapshot of (2); a put after (1) checks the hold inside its own write transaction (`held`) and is
refused. A block forgotten leaves no tombstone, and any tombstone of its key goes with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import lmdb

from kvledger.store.backend import shown_name
from kvledger.store.forget import Forgotten, owned_by, tenant_tag
from kvledger.store.lmdb_gc import TXN_BLOCKS, pause
from kvledger.store.lmdb_index import SEG_ID, U64, LmdbIndex, SegRec
from kvledger.store.lmdb_tombs import Tombstones, tag_of

log = logging.getLogger("kvledger.store")
HOLD = b"hold:"


class Held(Exception):
    """A put of a namespace whose tenant is held (raised inside its write transaction, which it aborts)."""


def held(txn: lmdb.Transaction, index: LmdbIndex, stored_namespace: bytes, now: float) -> bool:
    """Whether a put of the namespace stored as `stored_namespace` is refused at `now` (epoch s): its tenant's hold
    runs past now. One LMDB get."""
    raw = txn.get(HOLD + tag_of(stored_namespace), db=index.meta)
    return raw is not None and U64.unpack(raw)[0] > now * 1000


def forget(index: LmdbIndex, tombs: Tombstones, unlink: Callable[[list[str]], None], tenant: str, hold_s: float,
           now: float) -> Forgotten:
    """The module docstring's three steps for `tenant` at `now` (epoch s); files unlinked once each batch's commit
    is durable (`unlink`). An LMDB fault stops it where it is (logged; the counts say what went)."""
    got = Forgotten()
    tag = tenant_tag(tenant)
    try:
        if hold_s > 0:
            got.held_until = now + hold_s
            with index.env.begin(write=True) as w:
                w.put(HOLD + tag, U64.pack(int(got.held_until * 1000)), db=index.meta)
        with index.env.begin() as txn, txn.cursor(db=index.segs) as cur:
            segs = [SEG_ID.unpack(k)[0] for k, raw in cur if owned_by(shown_name(SegRec.unpack(raw).namespace), tenant)]
            buried = tombs.of_tenant(txn, tag)
        _remove_segments(index, tombs, unlink, segs, got)
        for i in range(0, len(buried), TXN_BLOCKS):
            with index.env.begin(write=True) as w:
                got.tombstones += tombs.remove(w, buried[i:i + TXN_BLOCKS])
            got.keys += buried[i:i + TXN_BLOCKS]
        index.persist()
    except lmdb.Error as e:
        got.faults += 1
        log.warning("forget of a tenant in %s stopped: %s", index.env.path(), e)
    return got


def _remove_segments(index: LmdbIndex, tombs: Tombstones, unlink: Callable[[list[str]], None], seg_ids: list[int],
                     got: Forgotten) -> None:
    """Remove the segments `seg_ids` and every block they still hold, about TXN_BLOCKS blocks a transaction, and
    the tombstones of those keys; counted into `got`."""
    i = 0
    while i < len(seg_ids):
        paths: list[str] = []
        with index.env.begin(write=True) as w:
            t0, n = time.perf_counter(), 0
            while i < len(seg_ids) and n < TXN_BLOCKS:
                seg = index.seg(w, seg_ids[i])
                if seg is not None:
                    keys, nbytes, path = index.remove_segment(w, seg_ids[i], seg)
                    tombs.remove(w, keys)
                    got.blocks, got.bytes, got.files = got.blocks + len(keys), got.bytes + nbytes, got.files + 1
                    got.keys += keys
                    paths.append(path)
                    n += max(len(keys), 1)
                i += 1
        unlink(paths)
        pause(time.perf_counter() - t0)
