"""The block ledger: KV bytes of whole blocks by chain key, on disk (embedded) or on Redis (shared).

    backend.py       the store protocol and its records (PutResult, StoreStats, ...)
    segment.py       on-disk format of a segment file (metadata first, then blocks in chain order)
    index.py         the in-process index (MemoryIndex), the CHECK walk, contiguous runs
    segment_files.py the segment directory's I/O: flock, whole-segment writes, reads via an fd cache
    file_index.py    index upkeep: rebuilt from segment metadata at open, kept in step with other writers
    file_gc.py       GC, eviction and the write-back of refreshed expiries (merged under the flock)
    file_inspect.py  stats and verify of the file store
    file_backend.py  FileStore: ties the above together (the embedded default)
    snapshots.py     the state ledger's snapshot files follow their chain block (`store gc`, `store stats`)
    redis_backend.py RedisStore: Redis index (+ bytes, or bytes in segment files: the cluster mode)
    ttl.py           TTL classes (agent 3 d, chatbot 7 d) per namespace and per request
    gc.py            GC and eviction order: tails before heads
    ledger.py        BlockLedger: the facade engines and the entrypoint use
    cli.py           `kvledger store stats|gc|verify`
"""

from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import TtlPolicy

__all__ = ["BlockLedger", "TtlPolicy"]
