"""The write path of an `LmdbStore`: a segment file made durable, then indexed in one write transaction.

    Writer.write_segment   the blocks of one put → tmp/.tmp-TAG (segment_files.write_segment, fsync) → rename to
                           segments/XX/TAG.kvs
    Writer.index_rows      in a write transaction: the segment's record, and a record for each block that no
                           other writer indexed meanwhile (a key indexed and unexpired is skipped: written once)
    Writer.index_segment   both in one transaction of its own; files left unnamed are unlinked after the commit

The order is what makes a crash harmless: bytes durable → renamed → indexed. A crash before the
commit leaves a file the index does not name (`verify` removes it), never an index entry without bytes.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvledger.store import lmdb_forget
from kvledger.store import segment as seg_format
from kvledger.store.backend import ChainWrite, stored_name
from kvledger.store.lmdb_index import BLOCK, BLOCK_TAIL, SEG_LE, BlockRec, LmdbIndex, SegRec
from kvledger.store.segment_files import HOST, write_segment
from kvledger.util.private_file import open_private, private_dir

ExpiryOf = Callable[[lmdb.Transaction, int, dict[int, float]], float]  # (txn, segment id, cache) → expiry (s)

COMPACT_BELOW = 0.5    # a segment whose live share of its data bytes falls below this is rewritten by gc
class PreparedSegment(NamedTuple):
    """A written segment's index rows, packed before the write transaction (so the lock is held for puts only)."""

    seg: SegRec
    keys: list[bytes]
    tails: list[bytes]   # each block's record without its segment id (BLOCK_TAIL)
    sizes: list[int]


def prepare(write: ChainWrite, path: str, rows: list[tuple], file_size: int, now: float) -> PreparedSegment:
    """Everything `index_prepared` writes, computed outside any transaction."""
    ns, cl = stored_name(write.namespace), stored_name(write.ttl_class)
    seg = SegRec(now + write.ttl_s, now, now, write.ttl_s, rows[0][2], len(rows), 0, 0,
                 sum(r[3] for r in rows), file_size, rows[0][1], ns, cl, path)
    tails = [BLOCK_TAIL.pack(i, pos, size, xxh, off, parent)
             for i, (_, parent, pos, size, xxh, off) in enumerate(rows)]
    return PreparedSegment(seg, [r[0] for r in rows], tails, [r[3] for r in rows])


@dataclass(slots=True)
class Writer:
    """The write path of one store folder: segments under `root` (fsynced unless `fsync` is false), indexed in
    `index`. `expiry_of` gives a segment's expiry including this process's noted refreshes (a key indexed but
    expired is taken over); `unlink` removes files once the commit that forgot them is durable."""

    index: LmdbIndex
    root: Path
    fsync: bool
    expiry_of: ExpiryOf
    unlink: Callable[[list[str]], None]

    def write_segment(self, write: ChainWrite, sel: Sequence[int], views: Sequence[memoryview],
                      now: float) -> tuple[str, list[tuple], int]:
        """Write, fsync and rename one segment file; (relative path, entry rows, file size)."""
        tag = f"{HOST}-{os.getpid()}-{secrets.token_hex(6)}"
        rel = f"segments/{tag[-2:]}/{tag}{seg_format.SUFFIX}"
        tmp = self.root / "tmp" / f".tmp-{tag}"
        fd = open_private(tmp, os.O_WRONLY | os.O_EXCL)   # 0600 whatever the writer's umask (DESIGN)
        try:
            rows, size = write_segment(fd, write, sel, views, now)
            if self.fsync:
                os.fsync(fd)
            final = self.root / rel
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                private_dir(final.parent)
                os.rename(tmp, final)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return rel, rows, size

    def index_segment(self, write: ChainWrite, path: str, rows: list[tuple], file_size: int, now: float) -> int:
        """One write transaction: the segment and those of its blocks nobody indexed meanwhile. `lmdb_forget.Held`
        (nothing indexed) when the write's tenant is held after a forget."""
        prep = prepare(write, path, rows, file_size, now)
        with self.index.env.begin(write=True) as w:
            if lmdb_forget.held(w, self.index, prep.seg.namespace, now):
                raise lmdb_forget.Held(write.namespace)
            live, unlink = self.index_prepared(w, prep, now)
        self.unlink(unlink)
        return live

    def index_rows(self, w: lmdb.Transaction, write: ChainWrite, path: str, rows: list[tuple], file_size: int,
                   now: float) -> tuple[int, list[str]]:
        """Index a written segment in `w`; (blocks indexed, files to unlink once `w` commits)."""
        return self.index_prepared(w, prepare(write, path, rows, file_size, now), now)

    def index_prepared(self, w: lmdb.Transaction, prep: PreparedSegment, now: float) -> tuple[int, list[str]]:
        """Index a prepared segment in `w`: its blocks that no other writer indexed meanwhile (one C-level insert
        that leaves existing keys alone; only when it left some are they looked at). A segment left with no
        block is not recorded and its file is returned for unlinking. (blocks indexed, files to unlink once
        `w` commits)."""
        idx = self.index
        seg = prep.seg
        seg_id = idx.new_seg_id(w)
        prefix = SEG_LE.pack(seg_id)
        values = [prefix + t for t in prep.tails]
        with w.cursor(db=idx.blocks) as cur:
            _, added = cur.putmulti(list(zip(prep.keys, values)), overwrite=False)
        keep: Sequence[int] = range(len(values))
        unlink: list[str | None] = []
        if added < len(values):   # rare: another writer indexed some of these keys since our dedupe
            keep, unlink = self._resolve(w, prep.keys, values, seg_id, now)
        if not keep:
            return 0, [p for p in unlink if p] + [seg.path]
        seg.live = len(keep)
        seg.live_bytes = sum(prep.sizes[i] for i in keep)
        idx.record_segment(w, seg_id, seg, prep.keys)
        idx.bump_many(w, {b"segments": 1, b"disk_bytes": seg.file_size})
        idx.add_live(w, seg, seg.live, seg.live_bytes)
        return seg.live, [p for p in unlink if p]

    def _resolve(self, w: lmdb.Transaction, keys: list[bytes], values: list[bytes], seg_id: int,
                 now: float) -> tuple[list[int], list[str | None]]:
        """After an insert that found some keys present: which entries are ours (indexed by it, or replacing an
        expired record), and the files the replaced records' segments leave to unlink."""
        keep, unlink = [], []
        cache: dict[int, float] = {}
        for i, key in enumerate(keys):
            raw = w.get(key, db=self.index.blocks)
            if raw == values[i]:
                keep.append(i)
                continue
            old = BlockRec(*BLOCK.unpack(raw))
            if old.seg == seg_id or self.expiry_of(w, old.seg, cache) >= now:
                continue   # a key twice in this write, or another writer indexed it first
            unlink.append(self.index.drop_block(w, key, old, COMPACT_BELOW))
            w.put(key, values[i], db=self.index.blocks)
            keep.append(i)
        return keep, unlink
