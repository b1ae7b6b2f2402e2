"""The block ledger: KV bytes of whole blocks by chain key, on disk (embedded) or on Redis (shared).

    backend.py       the store protocol and its records (PutResult, StoreStats, ...)
    open.py          open_block_store(StoreLocation): the one place a backend is chosen
    segment.py       on-disk format of a segment file (metadata first, then blocks in chain order)
    segment_files.py a flat segment directory's I/O: whole-segment writes, reads via an fd cache
    lmdb_store.py    LmdbStore: segment files + the persisted LMDB index (the embedded store; local folders only)
    lmdb_index.py    the LMDB index's tables and the writes that keep its invariants
    lmdb_write.py    its write path; lmdb_gc.py GC, eviction, compaction; lmdb_upkeep.py migration, verify, stats
    lmdb_tombs.py    its tombstones: when and why each removed block went (bounded), for `match_explained`
    chain_check.py   CHECK by bisection over a prompt's keys; refresher.py TTL refreshes off the CHECK path;
                     map_trim.py bounds the index map's share of a process's RSS
    redis_backend.py RedisStore: Redis index (+ bytes, or bytes in SharedFiles: the cluster mode)
    shared_files.py  the cluster mode's bytes: segment files on a shared mount, read by the location Redis keeps
    redis_keys.py    key names and hash slots; redis_meta.py the record and the Lua scripts; redis_upkeep.py views
    quota.py         guaranteed shares: who owns a block's bytes, and which blocks eviction may take (rule 12)
    redis_quota.py   a RedisStore's totals per bucket, its eviction down to capacity, and their sweep
    snapshots.py     the state ledger's snapshot files follow their chain block (`store gc`, `store stats`)
    forget.py        forgetting a tenant (rule 12): its tags, hold and receipt; lmdb_forget.py, redis_forget.py
                     each store's removal
    ttl.py           TTL classes (agent 3 d, chatbot 7 d) per namespace and per request
    ledger.py        BlockLedger: the facade engines and the entrypoint use
    cli.py           `kvledger store stats|gc|verify|forget`
"""

from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import TtlPolicy

__all__ = ["BlockLedger", "TtlPolicy"]
