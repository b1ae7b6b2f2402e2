"""BlockPool: refcounts, the prefix cache by chain key, LRU eviction, integrity."""

import pytest

from kvledger.engine.block_pool import BlockPool, NoFreeBlocks
from kvledger.engine.models.base import NULL_BLOCK

K = [bytes([i]) * 16 for i in range(8)]


def test_allocate_cache_free_lookup():
    pool = BlockPool(5)
    a = pool.allocate(2)
    assert NULL_BLOCK not in a and pool.counts() == (2, 0, 2)
    pool.cache(a[0], K[0])
    pool.cache(a[1], K[1])
    pool.free(a)
    assert pool.counts() == (2, 2, 0)
    assert pool.lookup(K[:3]) == a  # leading blocks only: K[2] was never cached
    assert pool.counts() == (2, 0, 2)
    pool.free(a)
    pool.check_integrity()


def test_eviction_takes_the_least_recently_released_and_drops_its_key():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for b, k in zip(blocks, K):
        pool.cache(b, k)
    pool.free(blocks)  # tails first: block of K[2] is released first, so it goes first
    (taken,) = pool.allocate(1)
    assert taken == blocks[2] and pool.lookup([K[0], K[1]]) == blocks[:2] and pool.lookup([K[2]]) == []
    pool.free(blocks[:2] + [taken])
    pool.check_integrity()


def test_shared_block_stays_until_last_reference():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, K[0])
    assert pool.lookup([K[0]]) == [b]
    pool.free([b])
    assert pool.counts() == (1, 0, 1)
    pool.free([b])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free([b])


def test_exhaustion_and_clear_cache():
    pool = BlockPool(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], K[0])
    pool.free(blocks)
    assert pool.clear_cache() == 1 and pool.lookup([K[0]]) == []
    pool.check_integrity()


def test_forget_drops_every_key_of_a_tenant_cached_or_in_use():
    """DESIGN rule 12: a forget finds a tenant's blocks by the tenant each keyed block names; a block in use keeps
    its bytes for its sequence, but nobody finds it by key again."""
    pool = BlockPool(6)
    a = pool.allocate(3)
    for block, key, tenant in zip(a, K, ("acme", "acme", "other")):
        pool.cache(block, key, tenant)
    pool.free(a[1:])                       # K[1] (acme) and K[2] (other) cached; K[0] (acme) still in use
    assert pool.forget("acme") == 2 and pool.forget("acme") == 0
    assert pool.cached_prefix(K[:1]) == 0 and pool.cached_prefix(K[2:3]) == 1
    pool.free(a[:1])
    pool.check_integrity()
    assert pool.counts() == (4, 1, 0)


def test_tails_and_host_snapshots_of_a_tenant_are_forgotten():
    from kvledger.engine.tails import TailStore
    from kvledger.state.pool import SlotPool

    tails = TailStore()
    tails.put(K[0], bytearray(8), "acme")
    tails.put(K[1], bytearray(8), "other")
    assert tails.forget("acme") == 1 and tails.take(K[0]) is None and tails.take(K[1]) == bytearray(8)
    with SlotPool(100, 4) as pool:
        for key, tenant in zip(K, ("acme", "acme", "other")):
            pool.put(key, 128, b"w" * 100, tenant)
        pinned = pool.pin(K[1])
        assert pool.discard_tenant("acme") == ([K[0]], 1)   # a pinned one stays for its reader
        pinned.view.release()
        pool.unpin(K[1])
        assert pool.discard_tenant("acme") == ([K[1]], 0) and list(pool.keys()) == [K[2]]
