"""The one place a block store is chosen: `open_block_store(StoreLocation(path=..., redis_url=...))`.

    path alone        embedded: segment files + the persisted LMDB index (LmdbStore); a folder of the
                      previous layout (segments without an index) is indexed at its first open
    redis_url alone   Redis, one server or a Redis Cluster (`redis+cluster://`): the index and the bytes
    both              the cluster mode: the Redis index, the bytes in segment files under `path`, a
                      shared mount (SharedFiles)

Errors are the callers' to map (the CLI turns each into its one line, exit 2): `ValueError` for a bad
location, a folder that is not the volume Redis describes, or one the embedded store refuses
(`lmdb_store.NotEmbeddedFolder`: a cluster store's folder, a network or FUSE filesystem), `OSError` /
`lmdb.Error` for a folder that does not open, and with `check=True` a Redis fault (`redis.RedisError`,
`OSError`) for a server that does not answer. Every later fault is absorbed by the store (backend.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvledger.store.backend import BlockStore
from kvledger.store.quota import Quotas
from kvledger.store.ttl import Clock, wall_clock

DEFAULT_PREFIX = "kvl:"


@dataclass(frozen=True, slots=True)
class StoreLocation:
    """Where a block store is: a folder, a Redis URL, or both (the cluster mode); `prefix` names its Redis
    keys. The same location opens the same store in any process (the fetcher's, another machine's)."""

    path: str | None = None
    redis_url: str | None = None
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if self.path is None and self.redis_url is None:
            raise ValueError("give path, redis_url, or both")


def open_block_store(location: StoreLocation, *, capacity_bytes: int | None = None, quotas: Quotas | None = None,
                     fsync: bool = True, clock: Clock = wall_clock, timeout_s: float = 2.0, create: bool = True,
                     check: bool = False, pin_index: bool = False) -> BlockStore:
    """The store at `location`. `capacity_bytes`: live block bytes past which a put evicts (both backends; on Redis
    the blocks' bytes, not the server's memory); `quotas`: the guarantees eviction keeps (quota.py; None: those
    the store records); `clock`: the embedded store's (Redis keeps its own time); `fsync=False` skips fsyncs
    (tests, builds); `create=False` refuses a folder that does not exist; `timeout_s` is every Redis call's
    deadline; `check=True` pings Redis now (the CLI's "does it answer"). `pin_index=True` keeps the embedded
    store's LMDB index in memory (index_pin.py; Redis's is in memory anyway)."""
    if location.redis_url is None:
        from kvledger.store.lmdb_store import LmdbStore

        return LmdbStore(location.path, capacity_bytes=capacity_bytes, fsync=fsync, clock=clock, create=create,
                         pin_index=pin_index, quotas=quotas)
    from kvledger.store.redis_backend import RedisStore
    from kvledger.store.shared_files import SharedFiles

    files = SharedFiles(location.path, fsync=fsync, create=create) if location.path is not None else None
    return RedisStore(location.redis_url, prefix=location.prefix, timeout_s=timeout_s, check=check, files=files,
                      capacity_bytes=capacity_bytes, quotas=quotas)


def location_of(store: BlockStore) -> StoreLocation:
    """The location that opens `store` again (in another process)."""
    url = getattr(store, "url", None)
    if url is None:
        return StoreLocation(path=os.fspath(store.root))  # type: ignore[attr-defined]
    files = store.files  # type: ignore[attr-defined]
    return StoreLocation(os.fspath(files.root) if files is not None else None, url,
                         store.prefix.decode())  # type: ignore[attr-defined]
