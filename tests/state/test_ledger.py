import os
import uuid

import pytest

from kvledger.core import ModelSpec, chain_keys, decide_hit, prefill_store_positions
from kvledger.state import MemoryDirectory, RedisDirectory, StateLedger

SPEC = ModelSpec.preset("tiny-v4")
SIZE = SPEC.state_size_to_disk()
TOKEN = "t0ken"


def _window(seed: int) -> bytes:
    return os.urandom(SIZE) if seed < 0 else bytes([seed % 256]) * SIZE


def test_put_positions_fetch_and_the_hit_rule():
    tokens = list(range(1000))
    keys = chain_keys(tokens, SPEC)
    pos = prefill_store_positions(len(tokens), SPEC)[-1]  # 896 (the other is the cap, 768)
    with StateLedger(SPEC, token=TOKEN, capacity_bytes=4 * SIZE) as ledger:
        assert ledger.positions(keys) == set()
        data = os.urandom(SIZE)
        assert ledger.put(keys[pos // 128 - 1], pos, data)
        assert ledger.positions(keys) == {pos}
        assert ledger.positions(keys, at={pos}) == {pos} and ledger.positions(keys, at={pos - 128, 5000}) == set()
        assert ledger.fetch(keys[pos // 128 - 1]) == data and ledger.fetch(keys[0]) is None
        # a longer prompt with the same prefix: the snapshot at L1 makes the hit exact
        longer = tokens + list(range(5000, 5200))
        d = decide_hit(len(longer), 7, ledger.positions(chain_keys(longer, SPEC)), SPEC)
        assert d.swa_hit and d.hit_tokens == 896
        with pytest.raises(AssertionError):
            ledger.put(keys[0], 100, data)  # not a block boundary


def test_eviction_withdraws_from_the_directory():
    directory = MemoryDirectory()
    keys = [i.to_bytes(16, "big") for i in range(5)]
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=2 * 4096 * 16) as ledger:
        cap = ledger.pool.capacity
        for i in range(cap + 2):
            ledger.put(keys[i], 128 * (i + 1), _window(i))
        assert len(directory) == cap  # the two oldest left pool and directory together
        assert ledger.positions(keys) == {128 * (i + 1) for i in range(2, cap + 2)}


def test_two_ledgers_on_redis_pull_from_each_other(shared_redis):
    prefix = f"kvl:test:{uuid.uuid4().hex[:8]}:"
    mk = lambda name: StateLedger(SPEC, token=TOKEN, engine_id=name, capacity_bytes=8 * SIZE,  # noqa: E731
                                  directory=RedisDirectory(shared_redis.url, prefix=prefix))
    with mk("a") as a, mk("b") as b, StateLedger(SPEC, token=TOKEN, capacity_bytes=0,
                                                 directory=RedisDirectory(shared_redis.url, prefix=prefix)) as e:
        keys = chain_keys(list(range(1024)), SPEC)
        wa, wb = _window(-1), _window(-1)
        a.put(keys[1], 256, wa)
        b.put(keys[3], 512, wb)
        assert a.positions(keys) == b.positions(keys) == e.positions(keys) == {256, 512}
        assert b.fetch(keys[1]) == wa and a.fetch(keys[3]) == wb and e.fetch(keys[1]) == wa
        assert a.client.stats["hit"] == 1 and b.client.stats["hit"] == 1
        slot = bytearray(SIZE)
        assert e.fetch_into(keys[3], slot) == SIZE and slot == wb  # straight into an engine's slot
        assert a.fetch_into(keys[1], slot) == SIZE and slot == wa  # its own pool, no pull
        assert e.fetch_into(keys[5], slot) is None
        a.close()  # retires its holder: its snapshot reads as absent at once
        assert e.positions(keys) == {512} and e.fetch(keys[1]) is None


def test_a_wrong_token_ledger_cannot_read_anothers_snapshots(shared_redis):
    prefix = f"kvl:test:{uuid.uuid4().hex[:8]}:"
    with StateLedger(SPEC, token=TOKEN, capacity_bytes=2 * SIZE,
                     directory=RedisDirectory(shared_redis.url, prefix=prefix)) as a, \
            StateLedger(SPEC, token="other", capacity_bytes=0,
                        directory=RedisDirectory(shared_redis.url, prefix=prefix)) as intruder:
        key = b"\x01" * 16
        a.put(key, 128, _window(1))
        assert intruder.directory.lookup([key])[0] is not None  # the entry is there ...
        assert intruder.positions([key]) == set()  # ... but its MAC fails under another token
        assert intruder.fetch(key) is None
        # and pulling directly, past the directory, the holder refuses: its proof does not verify
        assert intruder.client.pull(a.address, key) is None and intruder.client.stats["auth"] == 1


def test_zero_keeps_nothing_and_asks_for_replay():
    with StateLedger(SPEC, token=TOKEN, strategy="zero") as ledger:
        assert ledger.pool is None and ledger.strategy.replay
        assert not ledger.put(b"\x01" * 16, 128, _window(1))
        assert ledger.positions([b"\x01" * 16]) == set() and ledger.fetch(b"\x01" * 16) is None
        d = decide_hit(1000, 7, ledger.positions([]), SPEC, replay=ledger.strategy.replay)
        assert d.replay and d.hit_tokens == d.block_hit_tokens


def test_full_and_periodic_persist_and_survive_the_holder(tmp_path):
    keys = chain_keys(list(range(4096)), SPEC)
    with StateLedger(SPEC, token=TOKEN, strategy="full", root=tmp_path / "full") as ledger:
        ledger.put(keys[0], 128, _window(1))
    with StateLedger(SPEC, token=TOKEN, strategy="full", root=tmp_path / "full") as fresh:
        assert fresh.positions(keys) == {128} and fresh.fetch(keys[0]) == _window(1)
    with StateLedger(SPEC, token=TOKEN, strategy="periodic:512", root=tmp_path / "p") as ledger:
        for i in range(8):
            ledger.put(keys[i], 128 * (i + 1), _window(i))
        assert ledger.positions(keys) == {128 * (i + 1) for i in range(8)}  # all in memory
    with StateLedger(SPEC, token=TOKEN, strategy="periodic:512", root=tmp_path / "p") as fresh:
        assert fresh.positions(keys) == {512, 1024}  # only multiples of 512 were persisted
        assert fresh.fetch(keys[3]) == _window(3) and fresh.fetch(keys[2]) is None


def test_bad_configurations():
    with pytest.raises(ValueError):
        StateLedger(SPEC, token=TOKEN, strategy="full")  # persists: needs a root
    with pytest.raises(ValueError):
        StateLedger(SPEC, token=TOKEN, strategy="periodic:100", root="/tmp")  # not a multiple of 128
    with pytest.raises(ValueError):
        StateLedger(ModelSpec.preset("smollm2-135m"), token=TOKEN)  # no sliding window


def test_redis_down_is_a_miss_not_an_error(redis_server):
    directory = RedisDirectory(redis_server.url, socket_timeout_s=0.5)
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=4 * SIZE) as ledger, \
            StateLedger(SPEC, token=TOKEN, capacity_bytes=0,
                        directory=RedisDirectory(redis_server.url, socket_timeout_s=0.5)) as other:
        ledger.put(b"\x01" * 16, 128, _window(1))
        redis_server.kill()
        assert ledger.put(b"\x02" * 16, 256, _window(2))  # kept in the pool; publishing failed
        assert ledger.faults["directory"] >= 1
        assert ledger.positions([b"\x01" * 16, b"\x02" * 16]) == {128, 256}  # its own pool still answers
        assert other.positions([b"\x01" * 16]) == set() and other.fetch(b"\x01" * 16) is None
