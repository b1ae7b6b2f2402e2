"""The operator views of a RedisStore that walk every block: blocks, stats, verify, and GC's removal
of unreadable metadata (and, in the cluster mode, of file blocks Redis forgot). One SCAN per master
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
from kvledger.store.redis_meta import MetaFields, decode_meta
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
                log.warning("scan of %s on %s stopped: %s", store.url, node, e)
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
        log.warning("scan of %s stopped: %s", store.url, e)


def remove_unreadable(store: RedisStore, batch: int) -> tuple[int, int]:
    """Delete blocks whose metadata does not parse; (removed, batches). Raises on a Redis fault."""
    bad: dict[int, tuple[redis.Redis, list[bytes]]] = {}
    for node, name, meta, ttl in scan(store, batch):
        if meta is None and ttl != -2:
            bad.setdefault(id(node), (node, []))[1].append(name)
    removed = batches = 0
    for node, names in bad.values():
        for i in range(0, len(names), batch):
            pipe = node.pipeline(transaction=False)
            for name in names[i:i + batch]:
                pipe.delete(name)
            removed += sum(int(x) for x in pipe.execute())
            batches += 1
    return removed, batches


def stats(store: RedisStore) -> StoreStats:
    st = StoreStats(store.backend, store.url)
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
        fst = store.files.stats()
        st.disk_bytes, st.segments = fst.disk_bytes, fst.segments
        st.location += f" + {fst.location}"
    else:
        with contextlib.suppress(*FAULTS):
            st.disk_bytes = sum(int(node.info("memory").get("used_memory", 0)) for node in store.nodes.masters())
    st.counters = store.counters.as_dict()
    return st


def verify(store: RedisStore, remove: bool) -> VerifyResult:
    """Re-read every block with its bytes and check size and xxh3; remove the bad ones. Raises on a fault."""
    checked = bad = removed = nbytes = 0
    for node, names in scan_names(store, 64):
        pipe = node.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, "m", "d")
        for name, (m, d) in zip(names, pipe.execute()):
            if m is None and d is None:
                continue  # expired between SCAN and HMGET
            checked += 1
            meta = decode_meta(m) if m is not None else None
            if meta is None or d is None or len(d) != meta[2] or xxhash.xxh3_64_intdigest(d) != meta[3]:
                bad += 1
                if remove:
                    removed += int(node.delete(name))
            else:
                nbytes += len(d)
    return VerifyResult(checked, bad, removed, nbytes)


def gc_files(store: RedisStore, batch: int, grace_s: float) -> tuple[int, int, int]:
    """Cluster mode: remove file blocks older than `grace_s` whose key Redis no longer holds, tails
    first; (removed, freed bytes, batches). Raises on a Redis fault (a fault must not read as "gone")."""
    files = store.files
    assert files is not None
    files.refresh(force=True)
    cutoff = time.time() - grace_s
    entries = [b for b in files.blocks() if b.created < cutoff]
    gone = []
    for i in range(0, len(entries), batch):
        chunk = entries[i:i + batch]
        alive = store._exists_or_raise([b.key for b in chunk])
        gone += [b for b, a in zip(chunk, alive) if not a]
    gone.sort(key=lambda e: -e.pos)
    before = files.stats().disk_bytes
    batches = 0
    for i in range(0, len(gone), batch):
        files.delete([e.key for e in gone[i:i + batch]])
        batches += 1
    return len(gone), max(before - files.stats().disk_bytes, 0), batches
