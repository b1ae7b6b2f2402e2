"""Redis Cluster: the launcher, the redis+cluster:// URL, and why the keys must travel in KEYS."""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter

import pytest
import redis

from kvledger.bench.redis_cluster_bench import OLD_MATCH
from kvledger.store.ledger import BlockLedger
from kvledger.store.redis_backend import RedisStore
from tests.store.test_cli import stats_gc_verify
from kvledger.util.redis_cluster import ClusterUrl, RedisCluster, cluster_client, parse_cluster_url

from kvledger.util.serve_process import free_port

from .conftest import BLOCK, chain


def test_cluster_url_parses_nodes_and_credentials():
    assert parse_cluster_url("redis+cluster://127.0.0.1:7000") == ClusterUrl((("127.0.0.1", 7000),))
    assert parse_cluster_url("redis+cluster://u:p%40ss@a:1,b:2/0") == ClusterUrl((("a", 1), ("b", 2)), "u", "p@ss")
    assert parse_cluster_url("redis+cluster://:pw@h:6379").password == "pw"
    for bad in ("redis://h:1", "redis+cluster://h", "redis+cluster://h:99999", "redis+cluster://h:1/3"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_launcher_starts_three_masters_covering_every_slot(redis_cluster):
    client = cluster_client(redis_cluster.url, 2.0)
    masters = client.get_primaries()
    assert len(masters) == 3 and len({m.port for m in masters}) == 3
    info = client.cluster_info(target_nodes=client.get_random_node())
    assert info["cluster_state"] == "ok" and int(info["cluster_slots_assigned"]) == 16384
    client.close()




@pytest.fixture
def prefix() -> str:
    return f"t{secrets.token_hex(6)}:"


def test_old_check_script_is_refused_by_every_master_the_new_one_answers(redis_cluster, prefix):
    """The old script reads keys it was not given: Redis Cluster refuses it on every node."""
    client = cluster_client(redis_cluster.url, 2.0)
    keys, blocks = chain(64)
    for k in keys:  # the old layout's names, present: each node's walk reaches a key another node serves
        client.hset(prefix.encode() + b"b:" + k, "m", b"x")
    for node in client.get_primaries():
        with pytest.raises(redis.ResponseError, match="non local key"):
            client.get_redis_connection(node).eval(OLD_MATCH, 0, b"".join(keys), 1000, prefix.encode() + b"b:")
    led = BlockLedger(RedisStore(redis_cluster.url, prefix=prefix))
    assert led.match(keys) == 0 and led.put_chain(keys, blocks) == (64, 0, 0) and led.match(keys) == 64
    client.close()
    led.close()


def test_store_cli_and_ledger_open_take_a_cluster_url(redis_cluster, run_cli):
    """The one test on this cluster under the default prefix `kvl:`."""
    with BlockLedger.open(redis_url=redis_cluster.url) as led:
        keys, blocks = chain(5, seed=11)
        assert led.put_chain(keys, blocks, ttl_class="agent").written == 5
    assert stats_gc_verify(run_cli, redis_cluster.url, 5)["checked"] == 5
    for url in (f"redis+cluster://127.0.0.1:{free_port()}", "redis+cluster://nohostport"):
        r = run_cli("store", "stats", "--redis-url", url, "--json")
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_blocks_spread_over_the_three_masters(redis_cluster, prefix):
    store = RedisStore(redis_cluster.url, prefix=prefix)
    keys, blocks = chain(600, seed=3)
    assert BlockLedger(store).put_chain(keys, blocks).written == 600
    per_master = [len(list(n.scan_iter(match=prefix + "b:*", count=1000))) for n in store.nodes.masters()]
    assert sum(per_master) == 600 and len(per_master) == 3
    assert all(150 <= c <= 250 for c in per_master), per_master  # 64 groups, about 21 per master
    assert store.stats().blocks == 600 and len(list(store.blocks())) == 600
    store.close()


def _port_of(store: RedisStore, key: bytes) -> int:
    """The port of the master serving `key`'s block."""
    return store.nodes.node_of(store.place.slot(key)).connection_pool.connection_kwargs["port"]


def _count_sends(monkeypatch) -> Counter:
    """Every batch written to a Redis socket, by port (one per round trip)."""
    sends: Counter = Counter()
    original = redis.connection.Connection.send_packed_command

    def counted(self, command, check_health=True):  # noqa: ANN001, ANN202
        sends[self.port] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)
    return sends


@pytest.mark.parametrize("n_blocks", [1, 64, 2048])
def test_check_is_one_round_trip_per_master_touched(redis_cluster, prefix, monkeypatch, n_blocks):
    store = RedisStore(redis_cluster.url, prefix=prefix)
    led = BlockLedger(store)
    keys, blocks = chain(n_blocks, seed=n_blocks)
    led.put_chain(keys, blocks)
    assert led.match(keys) == n_blocks  # scripts loaded, slot map learned
    sends = _count_sends(monkeypatch)
    assert led.match(keys) == n_blocks
    touched = {_port_of(store, k) for k in keys}
    assert set(sends) == touched and all(v == 1 for v in sends.values()), sends
    assert n_blocks < 64 or len(touched) == 3
    store.close()


def test_check_stops_at_the_first_absent_block_whatever_node_holds_it(redis_cluster, prefix):
    store = RedisStore(redis_cluster.url, prefix=prefix)
    led = BlockLedger(store)
    keys, blocks = chain(200, seed=5)
    led.put_chain(keys, blocks)
    client = cluster_client(redis_cluster.url, 2.0)
    for hole in (150, 37, 0):
        client.delete(store._k(keys[hole]))
        assert led.match(keys) == hole
    at = [client.pexpiretime(store._k(k)) for k in keys[1:37]]
    assert at == [at[0] - p for p in range(36)]  # one client instant over every master: tails first
    client.close()
    store.close()


def test_a_dead_master_costs_only_its_blocks_then_recovers(tmp_path):
    """Kill one master of three: CHECK answers the blocks before the first one it held, reads of its
    blocks miss, puts fail soft, views do not raise; nothing hangs. Restarted (empty), it serves again."""
    with RedisCluster() as cluster:
        store = RedisStore(cluster.url, timeout_s=0.5)
        led = BlockLedger(store)
        keys, blocks = chain(96, seed=8)
        assert led.put_chain(keys, blocks).written == 96
        victim = cluster.nodes[1]
        on_victim = [i for i, k in enumerate(keys) if _port_of(store, k) == victim.port]
        assert on_victim
        victim.kill()
        t0 = time.monotonic()
        assert led.match(keys) == on_victim[0]
        got = led.get_into(keys, [bytearray(BLOCK) for _ in keys])
        assert [i for i, n in enumerate(got) if n < 0] == on_victim and all(n == BLOCK for n in got if n >= 0)
        other, other_blocks = chain(32, seed=9)
        res = led.put_chain(other, other_blocks)
        assert res.failed > 0 and res.written + res.failed == 32
        assert led.exists(keys[:1]) == [on_victim[0] != 0]
        assert led.stats().blocks == 96 - len(on_victim) + res.written  # the views cover the live masters
        assert time.monotonic() - t0 < 10
        assert store.counters.match_failures == 1 and store.counters.put_failures == 1
        victim.start()
        deadline = time.monotonic() + 20
        while led.match(keys) != on_victim[0] or led.put_chain(keys, blocks).failed:
            assert time.monotonic() < deadline, "the restarted master never served again"
            time.sleep(0.2)
        assert led.match(keys) == 96
        store.close()


def test_redis_client_gives_the_engine_registry_a_cluster(redis_cluster, prefix):
    """The registry's keys share the `{engines}` tag: on a cluster it runs unchanged (one slot)."""
    from kvledger.engine.engine_registry import EngineInfo, Registry

    reg = Registry.from_url(redis_cluster.url, bytes(32), prefix=prefix, ttl_s=30)
    infos = [EngineInfo(f"e{i}", "prefill", f"http://127.0.0.1:{9000 + i}", "m", 128, 10, (0,), 1) for i in range(3)]
    for info in infos:
        reg.announce(info)
    assert reg.members() == infos
    reg.withdraw("e1")
    assert [m.engine_id for m in reg.members()] == ["e0", "e2"]


@pytest.mark.parametrize("brace", ["{tenant}:", "{}:"])
def test_a_prefix_with_braces_still_keeps_each_script_in_one_slot(redis_cluster, brace):
    """`{tenant}` pins every block to one slot on purpose; `{}` makes Redis hash whole names (groups
    by slot, not by tag): both still answer as one server does."""
    store = RedisStore(redis_cluster.url, prefix=f"t{secrets.token_hex(4)}{brace}")
    led = BlockLedger(store)
    keys, blocks = chain(150, seed=12)
    assert led.put_chain(keys, blocks) == (150, 0, 0) and led.match(keys) == 150
    assert led.delete(keys[70:71]) == 1 and led.match(keys) == 70
    assert led.exists(keys[69:72]) == [True, False, True]
    bufs = [bytearray(BLOCK) for _ in range(3)]
    assert led.get_into(keys[:3], bufs) == [BLOCK] * 3 and [bytes(b) for b in bufs] == blocks[:3]
    assert led.stats().blocks == 149
    store.close()


def test_our_resp_encoding_is_what_redis_py_sends():
    """The fan-out packs commands itself (the CHECK of 8,192 keys is one join): byte for byte redis-py's."""
    from kvledger.util.redis_fanout import command, script_call

    packer = redis.Connection()

    def ref(*args: object) -> bytes:
        return b"".join(bytes(x) for x in packer.pack_commands([args]))

    want = ref("EVALSHA", "ab", 2, b"p:k1", b"p:k2", 5, "")
    assert b"".join(script_call("ab", [b"k1", b"k2"], 5, "", head=b"p:")) == want
    assert b"".join(script_call("ab", [b"k1", b"k22"], b"7")) == ref("EVALSHA", "ab", 2, b"k1", b"k22", 7)
    assert b"".join(script_call("ab", [])) == ref("EVALSHA", "ab", 0)
    big = memoryview(bytes(range(256)) * 1024)
    assert b"".join(bytes(x) for x in command("HSET", b"n", "d", big, 3.5)) == ref("HSET", b"n", "d", big, 3.5)


def test_bench_redis_cluster_reports_both_side_by_side(run_cli, shared_redis, redis_cluster):
    r = run_cli("bench", "redis-cluster", "--json", "--reps", "3", "--keys", "16,300", "--lookup", "8",
                "--redis-url", shared_redis.url, "--cluster-url", redis_cluster.url)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for tag in ("check_16_hit", "check_300_hit", "check_300_cold", "lookup_8"):
        assert res[f"{tag}_single_ms"] > 0 and res[f"{tag}_cluster_ms"] > 0 and res[f"{tag}_ratio"] > 0
    assert res["check_300_hit_single_old_ms"] > 0  # the script of before, on the same blocks (it asserts 300)
    r = run_cli("bench", "redis-cluster", "--keys", "0", "--json")
    assert r.returncode == 2 and r.stdout == ""


def test_a_plain_url_at_a_cluster_node_is_refused_by_the_cli_and_a_miss_for_the_ledger(redis_cluster, run_cli,
                                                                                         prefix, caplog):
    node = f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0"
    r = run_cli("store", "stats", "--redis-url", node, "--json")
    assert r.returncode == 2 and "redis+cluster://" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    led = BlockLedger(RedisStore(node, prefix=prefix))
    keys, blocks = chain(40, seed=13)
    res = led.put_chain(keys, blocks)  # the keys this node does not serve answer MOVED: failed, not raised
    assert res.failed > 0 and led.match(keys) < 40
    assert "give a redis+cluster:// URL" in caplog.text


@pytest.mark.parametrize("where", ["shared_redis", "redis_cluster"])
def test_keys_of_any_length_read_as_absent(request, where, prefix):
    """Writes take 16-byte keys only; a read of any other bytes is a miss, never an exception."""
    store = RedisStore(request.getfixturevalue(where).url, prefix=prefix)
    odd = [b"", b"x", bytes(17), b"{}" * 9]
    assert store.match(odd, 60.0) == 0 and store.exists(odd) == [False] * 4
    assert store.get_into(odd, [bytearray(8) for _ in odd]) == [-1] * 4 and store.delete(odd) == 0
    store.close()


def test_a_stale_slot_map_costs_one_check_then_is_learned_again(redis_cluster, prefix):
    """A master answering MOVED (a resharded slot, here a poisoned map) is a fault for its keys once;
    the next CHECK has the slot map learned again."""
    store = RedisStore(redis_cluster.url, prefix=prefix)
    led = BlockLedger(store)
    keys, blocks = chain(50, seed=14)
    led.put_chain(keys, blocks)
    assert led.match(keys) == 50
    slot = store.place.slot(keys[0])
    right = store.nodes.node_of(slot)
    store.nodes._slot_node[slot] = next(m for m in store.nodes.masters() if m is not right)
    assert led.match(keys) == 0 and store.counters.match_failures == 1
    assert led.match(keys) == 50
    store.close()
