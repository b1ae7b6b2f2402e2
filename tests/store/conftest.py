"""Fixtures of the block-ledger tests: chains of blocks whose bytes are a function of their key,
and a clock the tests move by hand (TTL and GC without sleeping)."""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import pytest
import redis

from kvledger.core import ModelSpec, chain_keys, root_key
from kvledger.util.redis_cluster import cluster_client

SPEC = ModelSpec.preset("tiny-v4")
BLOCK = 4096  # small blocks keep the suite fast; the store does not care about the size


def block_of(key: bytes, size: int = BLOCK) -> bytes:
    """The bytes every test stores under `key` (so a reader can check what it got)."""
    return hashlib.shake_128(key).digest(size)


def chain(n: int, namespace: str = "default", seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * SPEC.block_size, dtype=np.uint32)
    keys = chain_keys(tokens, SPEC, namespace)
    return keys, [block_of(k) for k in keys]


def root(namespace: str = "default") -> bytes:
    return root_key(SPEC, namespace)


class FakeClock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


BACKENDS = ("lmdb", "redis", "cluster", "redis-cluster", "cluster-on-redis-cluster")


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path, shared_redis):
    """Each block store the ledger can run on, one test run per backend (the one contract suite).

    lmdb: segment files with the persisted LMDB index (the embedded store); redis: metadata and bytes
    on Redis; cluster: a Redis index with the bytes in segment files (SharedFiles); redis-cluster and
    cluster-on-redis-cluster: the same two on a real 3-master Redis Cluster. The Redis ones share one
    server (one cluster), each test under its own key prefix."""
    from kvledger.store.redis_backend import RedisStore
    from kvledger.store.shared_files import SharedFiles

    prefix = f"t{secrets.token_hex(6)}:"
    if request.param == "lmdb":
        from kvledger.store.lmdb_store import LmdbStore

        st = LmdbStore(tmp_path, fsync=False)
    elif request.param == "redis":
        st = RedisStore(shared_redis.url, prefix=prefix)
    elif request.param == "cluster":
        st = RedisStore(shared_redis.url, prefix=prefix, files=SharedFiles(tmp_path, fsync=False))
    elif request.param == "redis-cluster":
        st = RedisStore(request.getfixturevalue("redis_cluster").url, prefix=prefix)
    else:
        url = request.getfixturevalue("redis_cluster").url
        st = RedisStore(url, prefix=prefix, files=SharedFiles(tmp_path, fsync=False))
    yield st
    st.close()


@pytest.fixture(params=["server", "redis-cluster"])
def redis_at(request) -> tuple[str, str, object]:
    """(url, key prefix, a raw client) of a Redis of this test's own, or of the session's Redis Cluster."""
    if request.param == "server":
        server = request.getfixturevalue("redis_server")
        yield server.url, "kvl:", redis.Redis.from_url(server.url)
        return
    url = request.getfixturevalue("redis_cluster").url
    client = cluster_client(url, 2.0)
    yield url, f"t{secrets.token_hex(6)}:", client
    client.close()
