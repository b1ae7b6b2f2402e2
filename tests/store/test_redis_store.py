"""The Redis block store against a real redis-server: round trip, CHECK, TTL, faults."""

from __future__ import annotations

import os
import signal
import time


from kvledger.store.ledger import BlockLedger
from kvledger.store.redis_backend import RedisStore
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import BLOCK, chain


def test_ttl_tails_expire_first_and_hits_refresh(redis_at):
    url, prefix, r = redis_at
    store = RedisStore(url, prefix=prefix)
    led = BlockLedger(store)
    keys, blocks = chain(5)
    led.put_chain(keys, blocks, ttl_class="agent")
    ttl = [r.pttl(store._k(k)) for k in keys]
    assert all(3 * DAY_S * 1000 - 5000 < t <= 3 * DAY_S * 1000 for t in ttl)
    at = [r.pexpiretime(store._k(k)) for k in keys]
    assert at == [at[0] - p for p in range(5)]  # every tail expires before its head
    assert led.match(keys, ttl_class="agent") == 5
    at = [r.pexpiretime(store._k(k)) for k in keys]
    assert at == [at[0] - p for p in range(5)]  # ...and still after a refresh
    assert led.match(keys[:3], ttl_class="chatbot") == 3  # a chatbot hit extends to 7 days
    assert r.pttl(store._k(keys[0])) > 6 * DAY_S * 1000 and r.pttl(store._k(keys[4])) < 3 * DAY_S * 1000
    assert led.match(keys[:3], ttl_class="agent") == 3
    assert r.pttl(store._k(keys[0])) > 6 * DAY_S * 1000  # a hit never shortens
    # real expiry (Redis's own clock): a 1 s class
    short = BlockLedger(store, TtlPolicy.parse(f"blink={1 / DAY_S}"))
    k2, b2 = chain(3, seed=4)
    t0 = time.monotonic()
    short.put_chain(k2, b2, ttl_class="blink")
    assert short.match(k2, ttl_class="blink") == 3
    time.sleep(max(0.0, 1.2 - (time.monotonic() - t0)))
    assert short.match(k2, ttl_class="blink") == 0 and short.get_into(k2[:1], [bytearray(BLOCK)]) == [-1]


def test_corrupt_block_is_a_miss_counted_and_removed(redis_at):
    url, prefix, r = redis_at
    store = RedisStore(url, prefix=prefix)
    keys, blocks = chain(4)
    BlockLedger(store).put_chain(keys, blocks)
    bad = bytearray(blocks[1])
    bad[100] ^= 0xFF
    r.hset(store._k(keys[1]), "d", bytes(bad))
    r.hset(store._k(keys[2]), "m", b"junk")
    bufs = [bytearray(BLOCK) for _ in keys]
    assert store.get_into(keys, bufs) == [BLOCK, -1, -1, BLOCK]
    assert store.counters.misses_corrupt == 2
    assert store.match(keys, DAY_S) == 1  # the bad blocks were deleted
    r.hset(store._k(keys[3]), "d", b"short")
    assert store.verify() == (2, 1, 1, BLOCK)


def test_redis_stopped_mid_run_fails_soft_then_recovers(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    led = BlockLedger(store)
    keys, blocks = chain(6)
    led.put_chain(keys[:3], blocks[:3])
    redis_server.kill()
    t0 = time.monotonic()
    assert led.put_chain(keys, blocks) == (0, 0, 6)
    assert led.match(keys) == 0
    assert led.get_into(keys[:2], [bytearray(BLOCK)] * 2) == [-1, -1]
    assert led.exists(keys[:1]) == [False] and led.delete(keys[:1]) == 0
    assert time.monotonic() - t0 < 5
    assert store.counters.put_failures == 1 and store.counters.match_failures == 1
    redis_server.start()  # a restart without persistence: empty, and the same client works again
    assert led.match(keys) == 0
    assert led.put_chain(keys, blocks) == (6, 0, 0) and led.match(keys) == 6


def test_hung_redis_hits_the_socket_timeout(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.3)
    keys, blocks = chain(3)
    BlockLedger(store).put_chain(keys, blocks)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts nothing, answers nothing
    try:
        t0 = time.monotonic()
        assert store.match(keys, DAY_S) == 0
        assert store.get_into(keys, [bytearray(BLOCK)] * 3) == [-1] * 3
        assert time.monotonic() - t0 < 3
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert RedisStore(redis_server.url).match(keys, DAY_S) == 3
