"""Quotas (DESIGN.md rule 12, store/quota.py): a tenant with a guaranteed share keeps its hot prefix through another
tenant's flood, on the embedded store (LMDB) and on Redis (one server and a Redis Cluster, bytes inline or on files).

The review's case, scaled to 4 KiB blocks: capacity 40 blocks; alpha stores its 8-block prompt and hits it; beta
then stores 60 unique 2-block prompts (3 × the capacity); alpha's prompt must still match whole. Without a
quota (today's plain recency) the same flood leaves alpha nothing: the control below."""

from __future__ import annotations

import secrets

import pytest

from kvledger.store.backend import ChainWrite
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.quota import (CLASS, NAMESPACE, Bucket, Candidate, Owner, Quotas, bucket_of, parse_quota, pick,
                                  resolve_quotas)

from kvledger.util.redis_fanout import Call, command

from .conftest import BLOCK, chain

CAPACITY = 40 * BLOCK
HOT = 8          # alpha's prompt, blocks
FLOOD = 60       # beta's prompts, 2 blocks each
GUARANTEE = Quotas({"alpha": 10 * BLOCK})


def _put(store, keys, blocks, ns, ttl_class="chatbot"):
    return store.put(ChainWrite(keys, blocks, 0, bytes(16), ns, ttl_class, 3600.0))


def _flood(store, tick=lambda: None) -> int:
    """The review's sequence; alpha's matched blocks after beta's flood."""
    hot = chain(HOT, "alpha", seed=1)
    assert _put(store, *hot, "alpha").written == HOT
    tick()
    assert store.match(hot[0], 3600.0) == HOT
    for i in range(FLOOD):
        tick()
        assert _put(store, *chain(2, "beta", seed=100 + i), "beta").failed == 0
    tick()
    return store.match(hot[0], 3600.0)


def _lmdb(tmp_path, clock, quotas):
    return LmdbStore(tmp_path, fsync=False, clock=clock, capacity_bytes=CAPACITY, quotas=quotas)


# --- embedded ------------------------------------------------------------------------------------------


def test_lmdb_a_guaranteed_tenant_keeps_its_prefix_through_a_flood(tmp_path, clock):
    with _lmdb(tmp_path, clock, GUARANTEE) as store:
        assert _flood(store, lambda: clock.advance(1)) == HOT
        st = store.stats()
        assert st.live_bytes <= CAPACITY and store.counters.gc_evicted >= 2 * FLOOD - 40
        assert st.namespace_bytes["alpha"] == HOT * BLOCK and st.namespace_bytes["beta"] == st.live_bytes - HOT * BLOCK
        assert st.guarantees == {"namespaces": {"alpha": 10 * BLOCK}, "classes": {}}
        assert store.counters.quota_overrides == 0


def test_lmdb_without_a_quota_the_flood_evicts_the_tenant(tmp_path, clock):
    """Today's behaviour, kept when no quota is set: plain recency across the whole store."""
    with _lmdb(tmp_path, clock, Quotas()) as store:
        assert _flood(store, lambda: clock.advance(1)) == 0


def test_lmdb_over_subscribed_guarantees_fall_back_to_recency(tmp_path, clock):
    both = Quotas({"alpha": 30 * BLOCK, "beta": 30 * BLOCK})   # 60 blocks guaranteed in a store of 40
    with _lmdb(tmp_path, clock, both) as store:
        _flood(store, lambda: clock.advance(1))
        assert store.stats().live_bytes <= CAPACITY
        assert store.counters.quota_overrides > 0


def test_lmdb_totals_survive_reopen_and_match_the_segments(tmp_path, clock):
    with _lmdb(tmp_path, clock, GUARANTEE) as store:
        _flood(store, lambda: clock.advance(1))
        before = store.stats()
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:   # no quotas given: the recorded ones
        st = store.stats()
        assert store.quotas == GUARANTEE and st.namespace_bytes == before.namespace_bytes
        by_scan: dict[str, int] = {}
        for b in store.blocks():
            by_scan[b.namespace] = by_scan.get(b.namespace, 0) + b.size
        assert by_scan == st.namespace_bytes and sum(by_scan.values()) == st.live_bytes


def test_lmdb_an_index_from_before_buckets_is_counted_at_open(tmp_path, clock):
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        _put(store, *chain(3, "alpha#salt-00ff", seed=1), "alpha#salt-00ff")
        _put(store, *chain(2, "beta", seed=2), "beta", "agent")
        with store.index.env.begin(write=True) as w:   # as an index written before quotas looks
            w.drop(store.index.buckets, delete=False)
            w.drop(store.index.by_bucket_hit, delete=False)
            w.delete(b"buckets", db=store.index.meta)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        st = store.stats()
        assert st.namespace_bytes == {"alpha": 3 * BLOCK, "beta": 2 * BLOCK}   # a salt counts as its tenant's
        assert st.class_bytes == {"chatbot": 3 * BLOCK, "agent": 2 * BLOCK}


# --- Redis ---------------------------------------------------------------------------------------------

REDIS_KINDS = ("redis", "cluster", "redis-cluster")


@pytest.fixture(params=REDIS_KINDS)
def redis_store(request, tmp_path, shared_redis):
    """A RedisStore factory on one server (bytes inline, or on files: the cluster mode) or a Redis Cluster."""
    from kvledger.store.redis_backend import RedisStore
    from kvledger.store.shared_files import SharedFiles

    url = request.getfixturevalue("redis_cluster").url if request.param == "redis-cluster" else shared_redis.url
    prefix = f"t{secrets.token_hex(6)}:"
    opened = []

    def make(quotas):
        files = SharedFiles(tmp_path, fsync=False) if request.param == "cluster" else None
        opened.append(RedisStore(url, prefix=prefix, files=files, capacity_bytes=CAPACITY, quotas=quotas))
        return opened[-1]

    yield make
    for s in opened:
        s.close()


def test_redis_a_guaranteed_tenant_keeps_its_prefix_through_a_flood(redis_store):
    store = redis_store(GUARANTEE)
    assert _flood(store) == HOT
    st = store.stats()
    assert st.live_bytes <= CAPACITY and store.counters.gc_evicted >= 2 * FLOOD - 40
    assert st.namespace_bytes["alpha"] == HOT * BLOCK and st.namespace_bytes["beta"] == st.live_bytes - HOT * BLOCK
    assert st.guarantees == {"namespaces": {"alpha": 10 * BLOCK}, "classes": {}}
    assert store.counters.quota_overrides == 0


def test_redis_without_a_quota_the_flood_evicts_the_tenant(redis_store):
    assert _flood(redis_store(Quotas())) == 0


def test_redis_over_subscribed_guarantees_fall_back_to_recency(redis_store):
    store = redis_store(Quotas({"alpha": 30 * BLOCK, "beta": 30 * BLOCK}))
    _flood(store)
    assert store.stats().live_bytes <= CAPACITY and store.counters.quota_overrides > 0


def test_redis_totals_follow_expiry_delete_and_repeat_puts(redis_store):
    store = redis_store(GUARANTEE)
    keys, blocks = chain(4, "alpha", seed=7)
    _put(store, keys, blocks, "alpha")
    _put(store, keys, blocks, "alpha")             # present: skipped, counted once
    assert store.stats().namespace_bytes == {"alpha": 4 * BLOCK}
    assert store.delete(keys[2:]) == 2
    assert store.stats().namespace_bytes == {"alpha": 2 * BLOCK}
    gone = [Call(store.place.slot(k), command("DEL", store.place.name(k))) for k in keys[:2]]
    assert store.nodes.run(gone) == [1, 1]        # as Redis's own expiry removes them: no script runs
    assert store.stats().namespace_bytes == {"alpha": 2 * BLOCK}   # counted until swept
    store.gc()
    assert store.stats().namespace_bytes == {}
    _put(store, keys, blocks, "alpha")             # written again: counted once again
    assert store.stats().namespace_bytes == {"alpha": 4 * BLOCK}


# --- the decision --------------------------------------------------------------------------------------


def test_parse_quota_names_a_namespace_or_a_class():
    classes = {"agent", "chatbot"}
    assert parse_quota("alpha=512MB", classes) == (Owner(NAMESPACE, "alpha"), 512_000_000)
    assert parse_quota("agent=1GiB", classes) == (Owner(CLASS, "agent"), 1 << 30)
    assert parse_quota("namespace:agent=10", classes) == (Owner(NAMESPACE, "agent"), 10)
    for bad in ("alpha", "=5", "alpha=0", "alpha=inf", "class:nope=5", "alpha=5X"):
        with pytest.raises(ValueError):
            parse_quota(bad, classes)


def test_resolve_quotas_precedence():
    flags = [(Owner(NAMESPACE, "alpha"), 7), (Owner(CLASS, "agent"), 9)]
    got = resolve_quotas(1000, flags, {"alpha": None, "beta": None, "gamma": 40})
    assert got == Quotas({"alpha": 7, "beta": 1000 // 6, "gamma": 40}, {"agent": 9})
    assert resolve_quotas(None, [], {"alpha": None}) == Quotas()        # no capacity: nothing to guarantee
    assert resolve_quotas(1000, [], None) == Quotas()                   # no key file: no default


def test_pick_stops_at_the_guarantee_and_walks_no_protected_block():
    a, b = bucket_of(b"alpha#salt-1", b"chatbot"), Bucket(b"beta", b"chatbot")
    usage = {a.id: (a, 50), b.id: (b, 100)}
    walked = []

    def stream(name, orders):
        for o in orders:
            walked.append((name, o))
            yield Candidate(o, 10, (name, o))

    streams = {a.id: stream("a", range(0, 50, 10)), b.id: stream("b", range(5, 105, 10))}
    picked = pick(Quotas({"alpha": 35}), usage, streams, need=130)
    taken = [c.handle for _, c in picked.victims]
    assert [h for h in taken if h[0] == "a"] == [("a", 0)]      # 50 − 10 ≥ 35; a second would leave 30 < 35
    assert picked.freed == 110 and len([h for h in taken if h[0] == "b"]) == 10
    assert [w for w in walked if w[0] == "a"] == [("a", 0), ("a", 10)]   # alpha's other blocks never read
