"""The block ledger: KV bytes of whole blocks by chain key, on disk (embedded) or on Redis (shared).

    backend.py       the store protocol and its records (PutResult, StoreStats, ...)
    segment.py       on-disk format of a segment file (metadata first, then blocks in chain order)
    index.py         the in-process index and the CHECK walk
    file_backend.py  FileStore: segment files + in-process index (the embedded default)
    redis_backend.py RedisStore: Redis index (+ bytes, or bytes in segment files: the cluster mode)
    ttl.py           TTL classes (agent 3 d, chatbot 7 d) per namespace and per request
    gc.py            GC and eviction order: tails before heads
    ledger.py        BlockLedger: the facade engines and the entrypoint use
    cli.py           `kvledger store stats|gc|verify`
"""

from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import TtlPolicy

__all__ = ["BlockLedger", "TtlPolicy"]
