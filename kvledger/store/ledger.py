"""`BlockLedger`: what engines and the entrypoint use of the block ledger.

    ledger = BlockLedger.open(path="/var/lib/kvledger")            # embedded (segment files + LMDB index)
    ledger = BlockLedger.open(redis_url="redis://127.0.0.1:6379/0")  # shared (Redis: index and bytes)
    ledger = BlockLedger.open(path="/mnt/3fs/kvl", redis_url=url)    # cluster (Redis index, shared files)
    keys, n = ledger.match_tokens(tokens, spec, namespace="tenant")  # CHECK, hashing included
    m = ledger.match_explained(keys, namespace="tenant")  # m.blocks, and m.gone: why keys[m.blocks] is absent
    ledger.put_chain(keys[n:], blocks, namespace="tenant", start_pos=n, parent=keys[n - 1])
    ledger.get_into(keys[:n], bufs)                                  # blocks into caller buffers

TTL: a request's class (or its namespace's, or the default) sets the TTL of what it writes
and refreshes what it hits. Faults never raise here (DESIGN.md rule 8): see backend.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvledger.core import KEY_BYTES, ModelSpec, extend_chain, root_key
from kvledger.store.backend import (Buffer, BlockStore, Dest, ChainWrite, GcResult, Match, PutResult, StoreStats,
                                    VerifyResult)
from kvledger.store.forget import Forgotten, forget_store
from kvledger.store.open import DEFAULT_PREFIX, StoreLocation, open_block_store
from kvledger.store.quota import Quotas
from kvledger.store.ttl import Clock, TtlPolicy, wall_clock

NO_PARENT = bytes(KEY_BYTES)  # parent recorded for a block at chain position 0 when the root key is not given
BLOCKS_DIR = "blocks"


def blocks_dir(data_dir: str | os.PathLike) -> Path:
    """The block store inside the `--data-dir` of `kvledger serve`, `entrypoint`, `engine` and `up`:
    `<data_dir>/blocks` (its `segments/` and LMDB index). Every process of one data dir opens this one."""
    return Path(data_dir) / BLOCKS_DIR


class BlockLedger:
    """A block store plus the TTL policy that decides each request's class."""

    def __init__(self, store: BlockStore, policy: TtlPolicy | None = None) -> None:
        self.store = store
        self.policy = policy or TtlPolicy()
        self._unreadable_seen = 0   # store.counters.misses_unreadable at the last `read_fault`

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, redis_url: str | None = None, *,
             policy: TtlPolicy | None = None, capacity_bytes: int | None = None, quotas: Quotas | None = None,
             fsync: bool = True, clock: Clock = wall_clock, timeout_s: float = 2.0, prefix: str = DEFAULT_PREFIX,
             pin_index: bool = False) -> BlockLedger:
        """`path` alone: embedded (segment files and the persisted LMDB index every process of the node shares);
        `redis_url` alone: Redis holds metadata and bytes; both: the cluster mode (Redis index, bytes in
        segment files under `path`, a shared mount); `prefix` names the Redis keys; `pin_index` keeps the embedded
        index in memory; `capacity_bytes` and `quotas`: what eviction keeps (quota.py). See `open_block_store`."""
        location = StoreLocation(None if path is None else os.fspath(path), redis_url, prefix)
        return cls(open_block_store(location, capacity_bytes=capacity_bytes, quotas=quotas, fsync=fsync, clock=clock,
                                    timeout_s=timeout_s, pin_index=pin_index), policy)

    # --- CHECK -----------------------------------------------------------------

    def match(self, keys: Sequence[bytes], *, namespace: str = "default", ttl_class: str | None = None) -> int:
        """Leading blocks of `keys` (from chain position 0) present, from metadata only; refreshes them."""
        _, ttl_s = self.policy.resolve(namespace, ttl_class)
        return self.store.match(keys, ttl_s)

    def match_explained(self, keys: Sequence[bytes], *, namespace: str = "default",
                        ttl_class: str | None = None) -> Match:
        """`match` (same blocks, same refresh, same faults) and, when a key is absent, the tombstone of the
        first absent one: expired or evicted, and when (`Gone`); None for a key never stored or a fault.
        Same call, same round trip."""
        _, ttl_s = self.policy.resolve(namespace, ttl_class)
        return self.store.match_explained(keys, ttl_s)

    def match_tokens(self, tokens: Any, spec: ModelSpec, *, namespace: str = "default",
                     ttl_class: str | None = None) -> tuple[list[bytes], int]:
        """CHECK of a prompt: its chain keys and how many leading blocks are present.

        `tokens` is best a numpy uint32 array (a Python list is accepted; converting a long
        one costs more than the CHECK itself)."""
        keys = extend_chain(root_key(spec, namespace), tokens, spec.block_size)
        return keys, self.match(keys, namespace=namespace, ttl_class=ttl_class)

    # --- blocks ----------------------------------------------------------------

    def put_chain(self, keys: Sequence[bytes], blocks: Sequence[Buffer], *, namespace: str = "default",
                  start_pos: int = 0, parent: bytes | None = None, ttl_class: str | None = None) -> PutResult:
        """Store the blocks of one chain at positions start_pos.. (idempotent: present blocks are skipped).

        `parent`: the key before keys[0] (required when start_pos > 0)."""
        if parent is None:
            if start_pos:
                raise ValueError("parent is required when start_pos > 0")
            parent = NO_PARENT
        cls, ttl_s = self.policy.resolve(namespace, ttl_class)
        if not keys:
            return PutResult(0, 0, 0)
        return self.store.put(ChainWrite(keys, blocks, start_pos, parent, namespace, cls, ttl_s))

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Dest]) -> list[int]:
        """Each block into its buffer; per key its size in bytes, or -1 for a miss."""
        return self.store.get_into(keys, bufs)

    def read_prefix(self, keys: Sequence[bytes], bufs: Sequence[Dest]) -> int:
        """Read blocks into buffers; the number of leading blocks that arrived intact."""
        n = 0
        for size in self.get_into(keys, bufs):
            if size < 0:
                break
            n += 1
        return n

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.store.exists(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.store.delete(keys)

    def forget(self, tenant: str, *, hold_s: float, root: str | os.PathLike | None = None) -> Forgotten:
        """Forget a tenant: its blocks, tombstones and (under `root`) snapshot files; a hold on its writes
        (`store.forget.forget_store`)."""
        return forget_store(self.store, tenant, hold_s=hold_s, root=root)

    # --- upkeep ----------------------------------------------------------------

    def gc(self, batch: int = 4096) -> GcResult:
        return self.store.gc(batch)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def read_fault(self) -> str | None:
        """None while this machine reads its store; else why not: the folder does not answer (a dead mount,
        ENOTCONN), or block reads failed with a local error (UNREADABLE) since the last call. A cluster
        engine leaves the registry while this is not None (rule 8: a local fault takes the machine out of
        service; it removes no block)."""
        why = self.store.probe()
        unreadable = self.store.counters.misses_unreadable
        if why is None and unreadable > self._unreadable_seen:
            why = f"{unreadable - self._unreadable_seen} block reads failed with a local error"
        self._unreadable_seen = unreadable
        return why

    def verify(self, remove: bool = True) -> VerifyResult:
        return self.store.verify(remove)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> BlockLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
