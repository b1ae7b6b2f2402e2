"""Tombstones (issue 24): why the first absent block of a CHECK is absent — expired or evicted, and when —
answered by `match_explained` in the CHECK's own call, on the embedded store (LMDB) and on Redis."""

from __future__ import annotations

import os
import secrets
import time

import pytest
import redis

from kvledger.core.attribution import MissCause
from kvledger.store.backend import ChainWrite, Gone, Match
from kvledger.store.ledger import BlockLedger
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.redis_backend import RedisStore
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import BLOCK, chain
from .test_embedded_store import overwrite_in_every_block, segs

EXPIRED, EVICTED = MissCause.EXPIRED, MissCause.EVICTED


def put(store, keys, blocks, start=0, ttl_s=100.0):
    parent = keys[start - 1] if start else bytes(16)
    return store.put(ChainWrite(keys[start:], blocks[start:], start, parent, "default", "agent", ttl_s))


# --- the embedded store ------------------------------------------------------------------------------

def test_lmdb_expired_reads_as_expired_at_its_expiry_before_and_after_gc(tmp_path, clock):
    keys, blocks = chain(12)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys[:8], blocks[:8], ttl_s=100)
        clock.advance(10)
        put(store, keys, blocks, start=8, ttl_s=100)       # a second segment; extending refreshes the first
        expiry = clock.t + 100
        assert store.match_explained(keys, 100) == Match(12)
        clock.advance(101)                                  # both expired; not collected yet
        assert store.match_explained(keys, 100) == Match(0, Gone(EXPIRED, expiry))
        assert store.match(keys, 100) == 0
        clock.advance(50)
        assert store.gc().expired == 12
        assert store.match_explained(keys, 100) == Match(0, Gone(EXPIRED, expiry))   # its tombstone now
        assert store.match_explained(keys[8:], 100) == Match(0, Gone(EXPIRED, expiry))


def test_lmdb_explained_match_answers_and_refreshes_as_match_does(tmp_path, clock):
    keys, blocks = chain(10)
    other, _ = chain(3, seed=9)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.match_explained(keys, 100) == Match(0)                    # never stored: no tombstone
        put(store, keys[:6], blocks[:6], ttl_s=100)
        assert store.match_explained(keys, 100) == Match(6)                    # keys[6] never stored
        assert store.match_explained(keys[:3] + other, 100) == Match(3)
        clock.advance(90)
        assert store.match_explained(keys, 100) == Match(6)                    # refreshes to now + 100
        clock.advance(90)
        assert store.match(keys, 100) == 6
        assert store.match_explained([], 100) == Match(0)


def test_lmdb_eviction_for_room_leaves_evicted_tombstones(tmp_path, clock):
    keys, blocks = chain(10)
    other, other_blocks = chain(6, seed=3)
    with LmdbStore(tmp_path, fsync=False, clock=clock, capacity_bytes=14 * BLOCK) as store:
        put(store, keys[:5], blocks[:5])
        clock.advance(1)
        put(store, keys, blocks, start=5)
        clock.advance(1)
        assert store.match(keys[:5], 100) == 5     # hit: the head is the most recently used
        clock.advance(1)
        put(store, other, other_blocks)            # 16 blocks > 14: evict the least recently hit, the tail
        assert store.counters.gc_evicted == 5
        assert store.match_explained(keys, 100) == Match(5, Gone(EVICTED, clock.t))
        assert store.match_explained(other, 100) == Match(6)


def test_lmdb_gc_for_capacity_evicts_with_tombstones(tmp_path, clock):
    keys, blocks = chain(10)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
    clock.advance(5)
    with LmdbStore(tmp_path, fsync=False, clock=clock, capacity_bytes=5 * BLOCK) as store:
        assert store.gc().evicted == 10            # one segment: all of it, down to 0.9 × capacity
        assert store.match_explained(keys, 100) == Match(0, Gone(EVICTED, clock.t))


def test_lmdb_a_damaged_block_removed_leaves_an_evicted_tombstone(tmp_path, clock):
    keys, blocks = chain(6)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
    overwrite_in_every_block(tmp_path, 7, b"\xaa")
    clock.advance(3)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.get_into(keys[2:3], [bytearray(BLOCK)]) == [-1]   # a checksum miss: dropped from the index
        assert store.match_explained(keys, 100) == Match(2, Gone(EVICTED, clock.t))
        clock.advance(1)
        assert store.verify().removed == 5
        assert store.match_explained(keys, 100) == Match(0, Gone(EVICTED, clock.t))
        assert not segs(tmp_path)


def test_lmdb_delete_leaves_an_evicted_tombstone_and_a_put_makes_the_block_present_again(tmp_path, clock):
    keys, blocks = chain(6)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
        assert store.delete(keys[4:]) == 2
        assert store.match_explained(keys, 100) == Match(4, Gone(EVICTED, clock.t))
        put(store, keys, blocks, start=4)
        assert store.match_explained(keys, 100) == Match(6)


def test_lmdb_tombstones_persist_and_are_seen_by_another_store_of_the_folder(tmp_path, clock):
    keys, blocks = chain(4)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks, ttl_s=10)
        clock.advance(11)
        assert store.gc().expired == 4
    with LmdbStore(tmp_path, fsync=False, clock=clock) as again:
        assert again.match_explained(keys, 10) == Match(0, Gone(EXPIRED, clock.t - 1))


def test_the_table_is_bounded_and_drops_the_oldest(tmp_path, clock):
    keys, blocks = chain(30)
    with LmdbStore(tmp_path, fsync=False, clock=clock, tombstones=8) as store:
        for i in range(0, 30, 10):       # three segments of one chain (each put refreshes the ones before)
            put(store, keys[:i + 10], blocks[:i + 10], start=i, ttl_s=10)
            clock.advance(1)
        clock.advance(10)
        assert store.gc().expired == 30  # one expiry: buried tails first, so the head's are the newest
        with store.index.env.begin() as txn:
            assert store.tombs.count(txn) == 8 and txn.stat(store.index.tomb_order)["entries"] == 8
        kept = [i for i, k in enumerate(keys) if store.match_explained([k], 10).gone is not None]
        assert kept == list(range(2, 10))
        assert store.match_explained(keys[2:], 10) == Match(0, Gone(EXPIRED, clock.t - 1))
        assert store.match_explained(keys, 10) == Match(0)   # keys[0]'s tombstone went with the bound


def test_a_key_buried_again_keeps_one_tombstone(tmp_path, clock):
    keys, blocks = chain(3)
    with LmdbStore(tmp_path, fsync=False, clock=clock, tombstones=5) as store:
        for _ in range(4):
            put(store, keys, blocks)
            assert store.delete(keys) == 3
            clock.advance(1)
        with store.index.env.begin() as txn:
            assert store.tombs.count(txn) == 3 and txn.stat(store.index.tomb_order)["entries"] == 3
        assert store.match_explained(keys, 10) == Match(0, Gone(EVICTED, clock.t - 1))


def test_tombstone_bytes_at_scale(tmp_path, clock):
    """The figure the lmdb_tombs docstring states: bytes per tombstone in the index file, at 20,000."""
    n = 20_000
    with LmdbStore(tmp_path, fsync=False, clock=clock, tombstones=n) as store:
        keys = [os.urandom(16) for _ in range(n + 1000)]
        with store.index.env.begin(write=True) as w:
            for i in range(0, len(keys), 1000):
                store.tombs.bury(w, keys[i:i + 1000], EXPIRED, clock.t, [b"tenant.8"] * 1000)
        with store.index.env.begin() as txn:
            assert store.tombs.count(txn) == n
            pages = sum(txn.stat(db)["branch_pages"] + txn.stat(db)["leaf_pages"] + txn.stat(db)["overflow_pages"]
                        for db in (store.index.tombs, store.index.tomb_order))
            psize = txn.stat(store.index.tombs)["psize"]
        per = pages * psize / n
        print(f"tombstone bytes: {per:.0f} B each at {n}")
        assert 40 < per < 160


def test_a_ledger_resolves_the_class_and_passes_through(tmp_path, clock):
    led = BlockLedger(LmdbStore(tmp_path, fsync=False, clock=clock), TtlPolicy.parse("blink=0.001"))
    keys, blocks = chain(3)
    led.put_chain(keys, blocks, ttl_class="blink")
    clock.advance(0.001 * DAY_S + 1)
    assert led.match_explained(keys, ttl_class="blink") == Match(0, Gone(EXPIRED, clock.t - 1))
    with pytest.raises(ValueError):
        led.match_explained(keys, ttl_class="nope")
    led.close()


# --- Redis: one server and a Redis Cluster ---------------------------------------------------------------

BLINK = TtlPolicy.parse(f"blink={1 / DAY_S}")   # a 1 s class: Redis expires on its own clock, tests sleep


def near(gone: Gone | None, cause: MissCause, at: float, slack: float = 0.5) -> bool:
    return gone is not None and gone.cause == cause and abs(gone.at - at) < slack


def test_redis_expired_at_its_expiry_with_a_miss_in_the_middle(redis_at):
    url, prefix, _ = redis_at
    led = BlockLedger(RedisStore(url, prefix=prefix), BLINK)
    keys, blocks = chain(8, seed=21)
    t0 = time.time()
    assert led.put_chain(keys, blocks, ttl_class="blink").written == 8
    assert led.match_explained(keys, ttl_class="blink") == Match(8)
    assert led.match(keys[:3], ttl_class="chatbot") == 3         # the head lives on, 7 days
    time.sleep(max(0.0, 1.3 - (time.time() - t0)))
    m = led.match_explained(keys, ttl_class="blink")
    assert m.blocks == 3 and near(m.gone, EXPIRED, t0 + 1.0), m  # block 3 expired about 1 s after its put
    assert led.match(keys, ttl_class="blink") == 3
    led.close()


def test_a_tombstone_shares_its_blocks_slot():
    from redis.crc import key_slot

    from kvledger.store.redis_keys import Placement

    for prefix in (b"kvl:", b"kvl:{tenant}:"):
        place = Placement(prefix + b"b:", True, prefix + b"t:")
        keys = [bytes([i]) * 16 for i in range(64)]
        assert place.tombs and all(key_slot(place.tomb_name(k)) == place.slot(k) for k in keys)
        assert Placement(prefix + b"b:", False, prefix + b"t:").tomb_name(keys[1]) == prefix + b"t:" + keys[1]


def test_redis_never_stored_and_all_present_have_no_tombstone(redis_at):
    url, prefix, _ = redis_at
    led = BlockLedger(RedisStore(url, prefix=prefix))
    keys, blocks = chain(70, seed=22)
    assert led.match_explained(keys) == Match(0)
    led.put_chain(keys[:50], blocks[:50])
    assert led.match_explained(keys) == Match(50) and led.match_explained(keys[:50]) == Match(50)
    assert led.match_explained([]) == Match(0)
    led.close()


def test_redis_a_damaged_block_removed_or_deleted_is_evicted(redis_at):
    url, prefix, raw = redis_at
    store = RedisStore(url, prefix=prefix)
    led = BlockLedger(store)
    keys, blocks = chain(100, seed=23)
    led.put_chain(keys, blocks)
    raw.hset(store._k(keys[60]), "d", b"garbage")
    t = time.time()
    assert led.get_into(keys[60:61], [bytearray(BLOCK)]) == [-1]     # a checksum miss: unpublished
    m = led.match_explained(keys)
    assert m.blocks == 60 and near(m.gone, EVICTED, t), m
    assert led.delete(keys[37:38]) == 1                              # another script's group, earlier
    m = led.match_explained(keys)
    assert m.blocks == 37 and near(m.gone, EVICTED, time.time()), m
    assert led.put_chain(keys, blocks).written == 2 and led.match_explained(keys) == Match(100)
    led.close()


def test_redis_a_block_gone_before_its_expiry_without_kvledger_is_evicted_now(redis_at):
    """Redis removed it (maxmemory) or someone did: its tombstone says it was due later."""
    url, prefix, raw = redis_at
    store = RedisStore(url, prefix=prefix)
    keys, blocks = chain(5, seed=24)
    BlockLedger(store).put_chain(keys, blocks)
    raw.delete(store._k(keys[2]))
    m = store.match_explained(keys, DAY_S)
    assert m.blocks == 2 and near(m.gone, EVICTED, time.time()), m
    store.close()


def test_redis_tombstones_follow_refreshes_and_live_their_grace_past_the_block(redis_at):
    url, prefix, raw = redis_at
    store = RedisStore(url, prefix=prefix, tomb_grace_s=1.0)
    led = BlockLedger(store, BLINK)
    keys, blocks = chain(4, seed=25)
    led.put_chain(keys, blocks, ttl_class="agent")

    def expiries() -> list[tuple[int, int]]:
        return [(raw.pexpiretime(store._k(k)), raw.pexpiretime(store.place.tomb_name(k))) for k in keys]

    before = expiries()
    assert all(t == b + 1000 for b, t in before)
    assert [b for b, _ in before] == [before[0][0] - p for p in range(4)]       # tails first
    time.sleep(0.05)
    assert led.match(keys, ttl_class="agent") == 4 and expiries() == before    # within the grain: nothing written
    assert led.match(keys[:2], ttl_class="chatbot") == 2                       # 7 d: both rewritten, 1 s apart
    after = expiries()
    assert all(t == b + 1000 for b, t in after) and after[0][0] > before[0][0] + 3 * DAY_S * 1000
    assert after[2:] == before[2:] and after[1][0] == after[0][0] - 1
    # the grace bounds a tombstone's life past its block
    k2, b2 = chain(2, seed=26)
    t0 = time.time()
    led.put_chain(k2, b2, ttl_class="blink")
    time.sleep(max(0.0, 1.3 - (time.time() - t0)))
    assert near(led.match_explained(k2, ttl_class="blink").gone, EXPIRED, t0 + 1.0)
    time.sleep(max(0.0, 2.3 - (time.time() - t0)))
    assert led.match_explained(k2, ttl_class="blink") == Match(0)
    assert raw.exists(store.place.tomb_name(k2[0])) == 0
    store.close()


def test_redis_down_is_zero_blocks_and_no_tombstone(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    keys, blocks = chain(3, seed=27)
    BlockLedger(store).put_chain(keys, blocks)
    redis_server.kill()
    assert store.match_explained(keys, DAY_S) == Match(0)
    assert store.counters.match_failures == 1


def test_redis_cluster_a_dead_master_answers_the_blocks_before_it_without_tombstone():
    """A tombstone read on a live master after the dead one's first key is no answer: that key's fate is unknown."""
    from kvledger.util.redis_cluster import RedisCluster

    with RedisCluster() as cluster:
        store = RedisStore(cluster.url, timeout_s=0.5)
        keys, blocks = chain(96, seed=28)
        BlockLedger(store).put_chain(keys, blocks)
        victim = cluster.nodes[1]
        port = [store.nodes.node_of(store.place.slot(k)).connection_pool.connection_kwargs["port"] for k in keys]
        first = port.index(victim.port)
        later = next(i for i in range(first + 1, 96) if port[i] != victim.port)
        assert store.delete([keys[later]]) == 1
        victim.kill()
        assert store.match_explained(keys, DAY_S) == Match(first)
        if first:   # a block gone before the dead master's first one: its tombstone is the answer
            assert store.delete([keys[0]]) == 1 and store.match_explained(keys, DAY_S).gone.cause == EVICTED
        store.close()


def test_cluster_mode_lost_bytes_leave_an_evicted_tombstone(tmp_path, redis_server):
    led = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(4, seed=29)
    led.put_chain(keys, blocks)
    next((tmp_path / "segments").iterdir()).unlink()   # the shared filesystem lost them
    t = time.time()
    assert led.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [-1] * 4
    m = led.match_explained(keys)
    assert m.blocks == 0 and near(m.gone, EVICTED, t), m
    led.close()


@pytest.mark.parametrize("brace", ["{}:", "{:"])
def test_a_prefix_without_a_slot_in_common_keeps_no_tombstones_and_still_matches(redis_cluster, brace):
    """`{}`: Redis hashes whole names; `{` unclosed: the tag would be `…b:{g}` for a block, `…t:{g}` for its
    tombstone. Either way no slot in common: no tombstones, and CHECK answers as ever."""
    store = RedisStore(redis_cluster.url, prefix=f"t{secrets.token_hex(4)}{brace}")
    assert not store.place.tombs and store.place.tomb_name(b"k" * 16) is None
    led = BlockLedger(store)
    keys, blocks = chain(40, seed=30)
    assert led.put_chain(keys, blocks).written == 40 and led.delete(keys[20:21]) == 1
    assert led.match_explained(keys) == Match(20)
    store.close()


def test_redis_maxmemory_eviction_reads_as_evicted(redis_server):
    """Redis evicts for room (volatile-ttl: the soonest expiry first; tombstones expire G later, so they stay)."""
    raw = redis.Redis.from_url(redis_server.url)
    store = RedisStore(redis_server.url)
    led = BlockLedger(store)
    keys, blocks = chain(40, seed=31)
    led.put_chain(keys, blocks, ttl_class="agent")
    raw.config_set("maxmemory-policy", "volatile-ttl")
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 20 * BLOCK)
    more, more_blocks = chain(40, seed=32)
    led.put_chain(more, more_blocks, ttl_class="chatbot")   # 7 d: the agent blocks (3 d) go first
    assert int(raw.info("stats")["evicted_keys"]) > 0
    m = led.match_explained(keys, ttl_class="agent")
    assert m.blocks < 40 and near(m.gone, EVICTED, time.time()), m
    store.close()


def test_redis_gc_and_verify_removals_leave_evicted_tombstones(redis_at):
    """Unreadable metadata (GC) and bad bytes (verify) are damage: each removed block says evicted, then."""
    url, prefix, raw = redis_at
    store = RedisStore(url, prefix=prefix)
    keys, blocks = chain(30, seed=33)
    BlockLedger(store).put_chain(keys, blocks)
    raw.hset(store._k(keys[20]), "m", b"junk")
    t = time.time()
    assert store.gc().expired == 1
    m = store.match_explained(keys, DAY_S)
    assert m.blocks == 20 and near(m.gone, EVICTED, t), m
    raw.hset(store._k(keys[9]), "d", b"short")
    assert store.verify().removed == 1
    m = store.match_explained(keys, DAY_S)
    assert m.blocks == 9 and near(m.gone, EVICTED, time.time()), m
    store.close()
