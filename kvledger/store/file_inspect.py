"""Operator views of the embedded store: `stats` (from the index, no block byte read) and `verify`
(every live block read and checked; bad blocks and unreadable segments reported and removed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.store import gc as gc_plan
from kvledger.store.backend import MISS, StoreStats, VerifyResult
from kvledger.store.index import runs
from kvledger.store.segment_files import STALE_TMP_S

if TYPE_CHECKING:
    from kvledger.store.file_backend import FileStore


def file_stats(store: FileStore) -> StoreStats:
    """Figures of the blocks the store's index holds (the caller holds the store's lock)."""
    index = store.index
    st = StoreStats(store.backend, str(store.root), capacity_bytes=store.capacity_bytes)
    parents = {e.parent for e in index.values()}
    st.blocks = len(index)
    st.chains = sum(1 for k in index if k not in parents)
    st.live_bytes = index.live_bytes
    st.disk_bytes = store.disk_bytes()
    segments = list(index.segments)
    st.segments = len(segments)
    for e in index.values():
        s = e.seg
        st.per_class[s.ttl_class] = st.per_class.get(s.ttl_class, 0) + 1
        st.per_namespace[s.namespace] = st.per_namespace.get(s.namespace, 0) + 1
    st.oldest_created = min((s.created for s in segments if any(True for _ in s.live())), default=None)
    st.next_expiry = min((e.expiry for e in index.values()), default=None)
    st.counters = store.counters.as_dict() | {"duplicates": store.upkeep.duplicates,
                                              "bad_segments": len(store.upkeep.bad_segments)}
    return st


def file_verify(store: FileStore, remove: bool) -> VerifyResult:
    """Read and check every live block, 256 at a time (the caller holds the store's lock)."""
    checked = bad = removed = nbytes = 0
    for seg in list(store.index.segments):
        live = sorted(seg.live(), key=lambda e: e.idx)
        for chunk in gc_plan.batches(live, 256):
            bufs = [bytearray(e.size) for e in chunk]
            res = [MISS] * len(chunk)
            for run in runs(enumerate(chunk)):
                store.reader.read_run(run, bufs, res, drop=remove)
            checked += len(chunk)
            nbytes += sum(r for r in res if r > 0)
            bad += res.count(MISS)   # UNREADABLE (a read error here) is not proof a block is bad
        if remove and seg.trim:
            with store.files.flock():
                store.collector.reclaim({seg})
    removed = bad if remove else 0
    if remove:
        store.files.remove_stale_tmp(max_age_s=STALE_TMP_S)
    for name in list(store.upkeep.bad_segments):
        bad += 1
        if remove:
            removed += store.files.unlink_bad(name)
            store.upkeep.bad_segments.remove(name)
    return VerifyResult(checked, bad, removed, nbytes)
