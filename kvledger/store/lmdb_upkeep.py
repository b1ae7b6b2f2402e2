"""Upkeep of an LMDB-indexed folder off the hot paths: migration, verify, stats, dropping bad blocks, rewriting
a segment. Each function gets what it uses (the index, the folder, the store's read or unlink), not the store.

Migration (once per index, under an flock of DIR/.lock): a directory of the previous design
(segment files at DIR/segments/*.kvs, no index) is indexed in batches of segments, each batch one
transaction; a segment already indexed is skipped, so a crash mid-way resumes. A segment keeps its
live blocks (expired ones are left to the next gc, which counts them); its expiry and last hit become
the latest of its blocks'. Then `meta/format`
is set and no later open lists the directory again. The same path rebuilds a lost index from every
segment file (segments/XX/ too): an index LMDB cannot open is set aside as index.lmdb.bad-TIME.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import lmdb

from kvledger.core.attribution import MissCause
from kvledger.store import segment as seg_format
from kvledger.store.backend import StoreStats, VerifyResult, shown_name, stored_name
from kvledger.store.lmdb_index import BUCKETS_BUILT, FORMAT, SEG_ID, U64, BlockRec, LmdbIndex, SegRec
from kvledger.store.lmdb_tombs import Tombstones
from kvledger.store.quota import Quotas, bytes_by_name
from kvledger.store.lmdb_write import Writer
from kvledger.store.segment_files import pid_alive
from kvledger.util.private_file import open_private

log = logging.getLogger("kvledger.store")
MIGRATE_BATCH = 256     # segments per transaction
ORPHAN_AGE_S = 3600.0   # verify removes segment files the index does not name once they are this old
EXACT_CHAINS_UP_TO = 1_000_000  # stats counts chains (a scan of every block) up to this many blocks
QUOTAS_KEY = b"quotas"          # meta: the guarantees of the last process that opened the store with some (JSON)


def remove_dead_tmp(tmp_dir: Path, host: str) -> None:
    """Segments of writers of this host that died mid-write (never renamed in)."""
    for name in os.listdir(tmp_dir):
        parts = name.split("-")
        if len(parts) >= 4 and parts[1] == host and parts[2].isdigit() and not pid_alive(int(parts[2])):
            with suppress(OSError):
                os.unlink(tmp_dir / name)


def migrate(idx: LmdbIndex, root: Path) -> None:
    """Index the segment files under `root` that `idx` does not name, once (see the module docstring)."""
    with idx.env.begin() as txn:
        if idx.total(txn, b"format") >= FORMAT:
            return
    fd = open_private(root / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with idx.env.begin() as txn:
            if idx.total(txn, b"format") >= FORMAT:
                return
        names = _segment_files(root)
        for i in range(0, len(names), MIGRATE_BATCH):
            with idx.env.begin(write=True) as w:
                for name in names[i:i + MIGRATE_BATCH]:
                    if w.get(name.encode(), db=idx.paths) is None:
                        _migrate_one(idx, root, w, name)
        with idx.env.begin(write=True) as w:
            w.put(b"format", U64.pack(FORMAT), db=idx.meta)
        if names:
            log.info("indexed %d segments of %s (the previous layout)", len(names), root)
    finally:
        os.close(fd)


def build_buckets(idx: LmdbIndex) -> None:
    """Once per index written before buckets existed: each segment's live bytes into its bucket and its row into
    its bucket's eviction order, in one write transaction (other writers wait for it once; O(segments)). A new
    index has nothing to build: every segment since is added with its bucket (`LmdbIndex.add_live`)."""
    with idx.env.begin() as txn:
        if idx.total(txn, BUCKETS_BUILT):
            return
    with idx.env.begin(write=True) as w:
        if idx.total(w, BUCKETS_BUILT):
            return
        n = 0
        for seg_id, seg in _iter_segs(w, idx):
            idx.add_bucket_row(w, seg_id, seg)
            idx.bump_bucket(w, seg, seg.live_bytes)
            n += 1
        w.put(BUCKETS_BUILT, U64.pack(1), db=idx.meta)
    if n:
        log.info("counted %d segments of %s by namespace and class (quotas)", n, idx.env.path())


def settle_quotas(idx: LmdbIndex, quotas: Quotas | None) -> Quotas:
    """The guarantees a store opened with `quotas` keeps: those, recorded in the index (meta `quotas`, JSON) for
    `kvledger store stats` and for a process that opens the store without any (None), which gets the record."""
    if quotas is None:
        with idx.env.begin() as txn:
            raw = txn.get(QUOTAS_KEY, db=idx.meta)
        return Quotas.from_json(raw) if raw is not None else Quotas()
    with idx.env.begin(write=True) as w:
        w.put(QUOTAS_KEY, quotas.to_json(), db=idx.meta)
    return quotas


def _segment_files(root: Path) -> list[str]:
    """Relative paths of the segment files under root/segments: the previous layout's, and this one's (an index
    removed or set aside is rebuilt from them, TTL refreshes since their writing lost)."""
    out = []
    for dirpath, _, files in os.walk(root / "segments"):
        rel = os.path.relpath(dirpath, root)
        out += [f"{rel}/{n}" for n in files if n.endswith(seg_format.SUFFIX)]
    return sorted(out)


def _migrate_one(index: LmdbIndex, root: Path, w: lmdb.Transaction, rel: str) -> None:
    name = rel
    try:
        fd = os.open(root / rel, os.O_RDONLY)
    except OSError:
        return
    try:
        meta = seg_format.read_meta(fd)
        file_size = os.fstat(fd).st_size
    except (seg_format.BadSegment, OSError) as e:
        log.warning("segment %s is unreadable (%s): left for `kvledger store verify`", name, e)
        return
    finally:
        os.close(fd)
    keep = []
    for i, (key, parent, pos, size, xxh, offset) in enumerate(meta.entries):
        exp, hit = meta.expiry[i], meta.last_hit[i]
        exp = exp if math.isfinite(exp) and exp >= meta.created + meta.ttl_s else meta.created + meta.ttl_s
        hit = hit if math.isfinite(hit) and meta.created <= hit <= exp else meta.created
        if meta.flags[i] == seg_format.FLAG_LIVE and offset + size <= file_size:  # expired ones too: gc counts them
            keep.append((i, key, BlockRec(0, i, pos, size, xxh, offset, parent), exp, hit))
    if not keep:
        return
    ns, cl = stored_name(meta.namespace), stored_name(meta.ttl_class)
    e0 = meta.entries[0]
    seg = SegRec(max(k[3] for k in keep), max(k[4] for k in keep), meta.created, meta.ttl_s, e0[2], meta.layout.n,
                 0, 0, sum(e[3] for e in meta.entries), file_size, e0[1], ns, cl, rel)
    seg_id = index.add_segment(w, seg, [e[0] for e in meta.entries])
    for _, key, rec, _, _ in keep:
        if w.get(key, db=index.blocks) is None:
            index.add_block(w, key, rec._replace(seg=seg_id))
            seg.live += 1
            seg.live_bytes += rec.size
    index.add_live(w, seg, seg.live, seg.live_bytes)
    if seg.live == 0:
        index.remove_segment(w, seg_id, seg)   # every block a duplicate: the file is left to verify
    else:
        index.put_seg(w, seg_id, seg)


def drop_bad(tombs: Tombstones, unlink: Callable[[list[str]], None], bad: list[tuple[bytes, BlockRec]],
             now: float) -> None:
    """Forget blocks that failed their read, if the index still names those very bytes, burying them as evicted
    at `now` (removed as damaged)."""
    from kvledger.store.lmdb_write import COMPACT_BELOW

    index = tombs.index
    paths = []
    gone, tags = [], []
    try:
        with index.env.begin(write=True) as w:
            for key, rec in bad:
                now_rec = index.block(w, key)
                if now_rec is not None and now_rec.seg == rec.seg and now_rec.idx == rec.idx:
                    tags += tombs.tags_of(w, [now_rec])
                    paths.append(index.drop_block(w, key, now_rec, COMPACT_BELOW))
                    gone.append(key)
            tombs.bury(w, gone, MissCause.EVICTED, now, tags)
    except lmdb.Error as e:
        log.warning("cannot drop %d bad blocks: %s", len(bad), e)
    unlink([p for p in paths if p])


def rewrite_segment(read: Callable[[list[bytes], list[bytearray]], list[int]], writer: Writer, seg: SegRec,
                    live: list[tuple[bytes, BlockRec]]) -> tuple[str, list[tuple[bytes, BlockRec, int]], int] | None:
    """A new segment file (`writer`) holding the blocks `live` of `seg`, read back and checked on the way
    (`read`: the store's get_into); None if none read back."""
    from kvledger.store.backend import ChainWrite

    live.sort(key=lambda kr: kr[1].pos)
    bufs = [bytearray(r.size) for _, r in live]
    sizes = read([k for k, _ in live], bufs)
    ok = [(k, r, b) for (k, r), b, s in zip(live, bufs, sizes) if s >= 0]
    if not ok:
        return None
    write = ChainWrite([k for k, _, _ in ok], [b for _, _, b in ok], ok[0][1].pos, ok[0][1].parent,
                       shown_name(seg.namespace), shown_name(seg.ttl_class), seg.ttl_s)
    path, rows, file_size = writer.write_segment(write, list(range(len(ok))), [memoryview(b) for _, _, b in ok],
                                                 seg.created)
    return path, [(k, r, row[5]) for (k, r, _), row in zip(ok, rows)], file_size


def _iter_segs(txn: lmdb.Transaction, index: LmdbIndex) -> Iterator[tuple[int, SegRec]]:
    with txn.cursor(db=index.segs) as cur:
        for k, v in cur:
            yield SEG_ID.unpack(k)[0], SegRec.unpack(v)


def fill_stats(idx: LmdbIndex, st: StoreStats) -> StoreStats:
    """`st` with the index's figures: totals in O(1); per class / namespace a scan of the segment records;
    chains a scan of the blocks (only up to EXACT_CHAINS_UP_TO blocks, else reported as 0)."""
    with idx.env.begin() as txn:
        st.blocks, st.live_bytes = idx.total(txn, b"blocks"), idx.total(txn, b"live_bytes")
        st.disk_bytes, st.segments = idx.total(txn, b"disk_bytes"), idx.total(txn, b"segments")
        st.namespace_bytes, st.class_bytes = bytes_by_name(idx.usage(txn).values())
        for _, seg in _iter_segs(txn, idx):
            ns, cl = shown_name(seg.namespace), shown_name(seg.ttl_class)
            st.per_class[cl] = st.per_class.get(cl, 0) + seg.live
            st.per_namespace[ns] = st.per_namespace.get(ns, 0) + seg.live
            st.oldest_created = seg.created if st.oldest_created is None else min(st.oldest_created, seg.created)
        first = idx.first_due(txn, idx.by_expiry)
        st.next_expiry = None if first is None else first[0]
        if st.blocks <= EXACT_CHAINS_UP_TO:
            with txn.cursor(db=idx.blocks) as cur:
                recs = {k: BlockRec(*idx_unpack(v)) for k, v in cur}
            parents = {r.parent for r in recs.values()}
            st.chains = sum(1 for k in recs if k not in parents)
    return st


def idx_unpack(raw: bytes) -> tuple:
    from kvledger.store.lmdb_index import BLOCK

    return BLOCK.unpack(raw)


Read = Callable[[list[bytes], list[bytearray], bool], list[int]]   # (keys, buffers, drop the bad ones) → sizes


def verify(index: LmdbIndex, root: Path, read: Read, unlink: Callable[[list[str]], None], remove: bool = True,
           orphan_age_s: float = ORPHAN_AGE_S) -> VerifyResult:
    """Index against segments: every indexed block is read and checked (bad ones dropped when `remove`), and
    segment files the index does not name, older than `orphan_age_s` (a younger one may be a put between its
    rename and its commit), count as bad (removed when `remove`)."""
    checked = bad = removed = nbytes = 0
    with index.env.begin() as txn:
        seg_ids = [seg_id for seg_id, _ in _iter_segs(txn, index)]
    for seg_id in seg_ids:
        with index.env.begin() as txn:
            live = [(k, r) for i, k in enumerate(index.keys_of(txn, seg_id))
                    if (r := index.block(txn, k)) is not None and r.seg == seg_id and r.idx == i]
        for i in range(0, len(live), 256):
            chunk = live[i:i + 256]
            sizes = read([k for k, _ in chunk], [bytearray(r.size) for _, r in chunk], remove)
            checked += len(chunk)
            nbytes += sum(s for s in sizes if s > 0)
            bad += sizes.count(-1)
    removed = bad if remove else 0
    for path, age in _orphans(index, root):
        if age > orphan_age_s:
            bad += 1
            if remove:
                unlink([path])
                removed += 1
    return VerifyResult(checked, bad, removed, nbytes)


def _orphans(index: LmdbIndex, root: Path) -> list[tuple[str, float]]:
    """(relative path, age s) of segment files the index does not name."""
    import time

    out = []
    seg_root = root / "segments"
    with index.env.begin() as txn:
        for dirpath, _, files in os.walk(seg_root):
            for name in files:
                if not name.endswith(seg_format.SUFFIX):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if txn.get(rel.encode(), db=index.paths) is None:
                    try:
                        age = time.time() - os.stat(root / rel).st_mtime
                    except OSError:
                        continue
                    out.append((rel, age))
    return out
