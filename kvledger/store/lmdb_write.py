"""The write path of an `LmdbStore`: a segment file made durable, then indexed in one write transaction.

    write_segment   the blocks of one put → tmp/.tmp-TAG (writev, fsync) → rename to segments/XX/TAG.kvs
    index_rows      in a write transaction: the segment's record, and a record for each block that no other
                    writer indexed meanwhile (a key indexed and unexpired is skipped: written once)
    index_segment   both in one transaction of its own; files left unnamed are unlinked after the commit

The order is what makes a crash harmless: bytes durable → renamed → indexed. A crash before the
commit leaves a file the index does not name (`verify` removes it), never an index entry without bytes.
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING

import lmdb
import xxhash

from kvledger.store import segment as seg_format
from kvledger.store.backend import ChainWrite
from kvledger.store.lmdb_index import BlockRec, SegRec
from kvledger.store.segment_files import HOST, writev_all

if TYPE_CHECKING:
    from kvledger.store.lmdb_store import LmdbStore

COMPACT_BELOW = 0.5    # a segment whose live share of its data bytes falls below this is rewritten by gc
MAX_NAME_BYTES = 1024


def name_bytes(name: str) -> bytes:
    """A namespace or class name as recorded for stats (keys carry the full name)."""
    return name.encode("utf-8", "surrogatepass")[:MAX_NAME_BYTES]


def write_segment(store: LmdbStore, write: ChainWrite, sel: list[int], views: list[memoryview],
                   now: float) -> tuple[str, list[tuple], int]:
    """Write, fsync and rename one segment file; (relative path, entry rows, file size)."""

    ns, cl = name_bytes(write.namespace), name_bytes(write.ttl_class)
    offset = seg_format.Layout.of(len(sel), len(ns), len(cl)).data_off
    rows = []
    for i, v in zip(sel, views):
        parent = write.keys[i - 1] if i > 0 else write.parent
        rows.append((write.keys[i], parent, write.start_pos + i, v.nbytes, xxhash.xxh3_64_intdigest(v), offset))
        offset += v.nbytes
    meta = seg_format.encode_meta(ns.decode("utf-8", "replace"), cl.decode("utf-8", "replace"), write.ttl_s,
                                  now, rows, [now + write.ttl_s] * len(rows))  # names for people: see the index
    tag = f"{HOST}-{os.getpid()}-{secrets.token_hex(6)}"
    rel = f"segments/{tag[-2:]}/{tag}{seg_format.SUFFIX}"
    tmp = store.root / "tmp" / f".tmp-{tag}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writev_all(fd, [memoryview(meta), *views])
        if store.fsync:
            os.fsync(fd)
        final = store.root / rel
        try:
            os.rename(tmp, final)
        except FileNotFoundError:
            final.parent.mkdir(exist_ok=True)
            os.rename(tmp, final)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return rel, rows, offset

def index_segment(store: LmdbStore, write: ChainWrite, path: str, rows: list[tuple], file_size: int, now: float) -> int:
    """One write transaction: the segment and those of its blocks nobody indexed meanwhile."""
    with store.index.env.begin(write=True) as w:
        live, unlink = index_rows(store, w, write, path, rows, file_size, now)
    store.unlink(unlink)
    return live

def index_rows(store: LmdbStore, w: lmdb.Transaction, write: ChainWrite, path: str, rows: list[tuple], file_size: int,
               now: float) -> tuple[int, list[str]]:
    """Index a written segment in `w`; (blocks indexed, files to unlink once `w` commits)."""
    ns, cl = name_bytes(write.namespace), name_bytes(write.ttl_class)
    seg = SegRec(now + write.ttl_s, now, now, write.ttl_s, rows[0][2], len(rows), 0, 0,
                 sum(r[3] for r in rows), file_size, rows[0][1], ns, cl, path)
    unlink = []
    cache: dict[int, float] = {}
    seg_id = store.index.add_segment(w, seg, [r[0] for r in rows])
    for idx, (key, parent, pos, size, xxh, off) in enumerate(rows):
        old = store.index.block(w, key)
        if old is not None and store._expiry(w, old.seg, cache) >= now:
            continue  # another writer indexed it first
        if old is not None:
            unlink.append(store.index.drop_block(w, key, old, COMPACT_BELOW))
        store.index.add_block(w, key, BlockRec(seg_id, idx, pos, size, xxh, off, parent))
        seg.live += 1
        seg.live_bytes += size
    store.index.bump(w, b"blocks", seg.live)
    store.index.bump(w, b"live_bytes", seg.live_bytes)
    if seg.live == 0:
        unlink.append(store.index.remove_segment(w, seg_id, seg)[2])
    else:
        store.index.put_seg(w, seg_id, seg)
    return seg.live, [p for p in unlink if p]
