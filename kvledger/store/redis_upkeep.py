"""The operator views of a RedisStore that walk every block: blocks, stats, verify, and GC's removal
of unreadable metadata. One SCAN per master
(one server: the one), the names it returns read back in batches pipelined to that same master
(single-key commands: no hash slot is crossed)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import redis
import xxhash

from kvledger.store.backend import BlockInfo, StoreStats, VerifyResult
from kvledger.store.quota import bytes_by_name
from kvledger.store.redis_meta import MetaFields, decode_meta
from kvledger.store.shared_files import Outcome
from kvledger.util.redis_fanout import FAULTS

if TYPE_CHECKING:
    from kvledger.store.redis_backend import RedisStore

log = logging.getLogger("kvledger.store")


def scan_names(store: RedisStore, batch: int) -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """(master, Redis keys of blocks on it), `batch` at a time, every master in turn. A master whose
    SCAN fails is logged and skipped (the views cover the others); no master reachable raises."""
    for node in store.nodes.masters():
        cursor = 0
        while True:
            try:
                cursor, names = node.scan(cursor, match=store.bprefix + b"*", count=batch)
            except FAULTS as e:
                if not store.nodes.cluster:
                    raise
                log.warning("scan of %s on %s stopped: %s", store.shown, node, e)
                break
            if names:
                yield node, names
            if cursor == 0:
                break


def scan(store: RedisStore, batch: int = 1000) -> Iterator[tuple[redis.Redis, bytes, MetaFields | None, int]]:
    """(master, redis key, meta fields or None, ms to live) of every block, `batch` keys per round trip."""
    for node, names in scan_names(store, batch):
        pipe = node.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, "m")
            pipe.pttl(name)
        res = pipe.execute()
        for name, m, ttl in zip(names, res[0::2], res[1::2]):
            yield node, name, (decode_meta(m) if m is not None else None), ttl


def blocks(store: RedisStore) -> Iterator[BlockInfo]:
    """Every block Redis holds (those listed before a fault, if a server goes away mid-scan)."""
    now = time.time()
    try:
        for _, name, meta, ttl in scan(store):
            if meta is not None:
                parent, pos, size, _, created, _, ns, cls = meta
                expiry = now + ttl / 1000 if ttl >= 0 else None
                yield BlockInfo(store.place.key_of(name), parent, pos, size, created, expiry, ns, cls)
    except FAULTS as e:
        log.warning("scan of %s stopped: %s", store.shown, e)


def remove_unreadable(store: RedisStore, batch: int) -> tuple[int, int]:
    """Delete blocks whose metadata does not parse, each leaving an evicted tombstone (damaged); (removed,
    batches). Raises on a Redis fault of the scan (one of the removal is logged)."""
    bad = [name for _, name, meta, ttl in scan(store, batch) if meta is None and ttl != -2]
    removed = batches = 0
    for i in range(0, len(bad), batch):
        removed += store.bury([(store.nodes.slot(name), [name]) for name in bad[i:i + batch]])
        batches += 1
    return removed, batches


def stats(store: RedisStore) -> StoreStats:
    st = StoreStats(store.backend, store.shown, capacity_bytes=store.capacity_bytes,
                    guarantees=store.quotas.as_dict())
    if store.place.accounted:
        with contextlib.suppress(*FAULTS):
            usage = store.quota.overall(store.quota.usage()).values()
            st.namespace_bytes, st.class_bytes = bytes_by_name(usage)
    parents: set[bytes] = set()
    keys: list[bytes] = []
    for b in blocks(store):
        keys.append(b.key)
        parents.add(b.parent)
        st.blocks += 1
        st.live_bytes += b.size
        st.per_class[b.ttl_class] = st.per_class.get(b.ttl_class, 0) + 1
        st.per_namespace[b.namespace] = st.per_namespace.get(b.namespace, 0) + 1
        st.oldest_created = b.created if st.oldest_created is None else min(st.oldest_created, b.created)
        if b.expiry is not None:
            st.next_expiry = b.expiry if st.next_expiry is None else min(st.next_expiry, b.expiry)
    st.chains = sum(1 for k in keys if k not in parents)
    if store.files is not None:
        st.segments, st.disk_bytes = store.files.usage()
        st.location += f" + {store.files.root}"
    else:
        with contextlib.suppress(*FAULTS):
            st.disk_bytes = sum(int(node.info("memory").get("used_memory", 0)) for node in store.nodes.masters())
    st.counters = store.counters.as_dict()
    return st


def verify(store: RedisStore, remove: bool) -> VerifyResult:
    """Re-read every block with its bytes (from Redis, or from the file its location names) and check size
    and xxh3; remove the bad ones (a local read error on the files is bad here but removes nothing).
    Raises on a Redis fault."""
    checked = bad = removed = nbytes = 0
    field = "d" if store.files is None else "l"
    for node, names in scan_names(store, 64):
        pipe = node.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, "m", field)
        replies = [(n, m, x) for n, (m, x) in zip(names, pipe.execute()) if m is not None or x is not None]
        checked += len(replies)   # the rest expired between SCAN and HMGET
        verdicts = _check_inline(replies) if store.files is None else _check_files(store, replies)
        for (name, _, _), got in zip(replies, verdicts):
            if isinstance(got, int):
                nbytes += got
                continue
            bad += 1
            if remove and got != "unreadable":
                removed += store.bury([(store.nodes.slot(name), [name])])   # an evicted tombstone: damaged
    return VerifyResult(checked, bad, removed, nbytes)


def _check_inline(replies: list[tuple[bytes, bytes | None, bytes | None]]) -> list[Outcome]:
    """Each block's size, or "corrupt", for blocks whose bytes are in Redis."""
    out: list[Outcome] = []
    for _, m, d in replies:
        meta = decode_meta(m) if m is not None else None
        ok = meta is not None and d is not None and len(d) == meta[2] and xxhash.xxh3_64_intdigest(d) == meta[3]
        out.append(len(d) if ok else "corrupt")
    return out


def _check_files(store: RedisStore, replies: list[tuple[bytes, bytes | None, bytes | None]]) -> list[Outcome]:
    """Each block's size or why not, for blocks whose bytes are in the files (read by their location)."""
    assert store.files is not None
    out: list[Outcome] = ["corrupt"] * len(replies)
    located = [(i, loc) for i, (_, m, x) in enumerate(replies)
               if m is not None and (loc := store._location(m, x)) is not None]
    bufs = {i: bytearray(loc.size) for i, loc in located}
    for (i, _), got in zip(located, store.files.read(located, bufs)):
        out[i] = got
    return out
