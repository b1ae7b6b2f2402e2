import os
import signal
import time
import uuid
from collections import Counter

import pytest
import redis

from kvledger.state.directory import Holder, MemoryDirectory, SnapshotEntry
from kvledger.state.redis_directory import RedisDirectory, deadline, decode_entry, encode_entry
from kvledger.util.redis_cluster import RedisCluster

TTL = 0.8  # seconds; generous, so a loaded machine does not miss a heartbeat


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def directory(request):
    if request.param == "memory":
        d = MemoryDirectory(holder_ttl_s=TTL)
    else:
        server = request.getfixturevalue("shared_redis" if request.param == "redis" else "redis_cluster")
        d = RedisDirectory(server.url, prefix=f"kvl:test:{uuid.uuid4().hex[:8]}:", holder_ttl_s=TTL)
    yield d
    d.close()


def _entry(holder: Holder, i: int) -> SnapshotEntry:
    return SnapshotEntry(i.to_bytes(16, "big"), holder, 128 * (i + 1), 1415040, 1.7e9 + i)


def test_publish_lookup_batched(directory):
    h = Holder("e1", "127.0.0.1:5000")
    directory.heartbeat(h)
    directory.publish([_entry(h, i) for i in range(100)])
    keys = [i.to_bytes(16, "big") for i in range(105)]
    got = directory.lookup(keys)
    assert got[:100] == [_entry(h, i) for i in range(100)] and got[100:] == [None] * 5
    assert directory.lookup([]) == []


def test_withdraw_only_removes_the_withdrawing_holders_entry(directory):
    a, b = Holder("a", "127.0.0.1:1"), Holder("b", "127.0.0.1:2")
    directory.heartbeat(a)
    directory.heartbeat(b)
    directory.publish([_entry(a, 0), _entry(a, 1)])
    directory.publish([_entry(b, 1)])  # b now holds key 1 (newer)
    directory.withdraw([(0).to_bytes(16, "big"), (1).to_bytes(16, "big")], a)
    assert directory.lookup([(0).to_bytes(16, "big"), (1).to_bytes(16, "big")]) == [None, _entry(b, 1)]


def test_entries_of_a_holder_that_stops_heartbeating_expire(directory):
    live, dead = Holder("live", "127.0.0.1:1"), Holder("dead", "127.0.0.1:2")
    for h in (live, dead):
        directory.heartbeat(h)
    directory.publish([_entry(live, 0), _entry(dead, 1)])
    keys = [(0).to_bytes(16, "big"), (1).to_bytes(16, "big")]
    assert directory.lookup(keys) == [_entry(live, 0), _entry(dead, 1)]
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5 * TTL:
        directory.heartbeat(live)  # only `live` keeps beating
        time.sleep(TTL / 4)
    assert directory.lookup(keys) == [_entry(live, 0), None]


def test_a_restarted_holder_does_not_revive_its_old_entries(directory):
    old = Holder("e1", "127.0.0.1:1")
    directory.heartbeat(old)
    directory.publish([_entry(old, 0)])
    new = Holder("e1", "127.0.0.1:1")  # same engine id, new incarnation, empty pool
    assert new.incarnation != old.incarnation
    directory.heartbeat(new)
    assert directory.lookup([(0).to_bytes(16, "big")]) == [None]
    directory.retire(old)  # retiring the old incarnation does not kill the new one
    directory.publish([_entry(new, 1)])
    assert directory.lookup([(1).to_bytes(16, "big")]) == [_entry(new, 1)]
    directory.retire(new)
    assert directory.lookup([(1).to_bytes(16, "big")]) == [None]


def test_entry_encoding_round_trip_and_corruption():
    e = _entry(Holder("engine-ü", "[::1]:9000"), 3)
    assert decode_entry(e.key, encode_entry(e)) == e
    raw = encode_entry(e)
    for bad in (raw[:-1], raw + b"x", b"", b"\xff" * 5, raw[:3]):
        assert decode_entry(e.key, bad) is None


@pytest.mark.parametrize("where", ["shared_redis", "redis_cluster"])
def test_redis_entries_carry_ttls_and_garbage_values_read_as_absent(request, where):
    d = RedisDirectory(request.getfixturevalue(where).url, prefix=f"kvl:test:{uuid.uuid4().hex[:8]}:", holder_ttl_s=5,
                       entry_ttl_s=60)
    h = Holder("e1", "127.0.0.1:1")
    d.heartbeat(h)
    d.publish([_entry(h, 0)])
    key = (0).to_bytes(16, "big")
    assert 0 < d._r.pttl(d._snap(key)) <= 60_000 and 0 < d._r.pttl(d._live("e1")) <= 5_000
    d._r.set(d._snap(key), b"\x00garbage")
    assert d.lookup([key]) == [None]


def test_redis_down_reads_as_absent_not_an_error(redis_server):
    d = RedisDirectory(redis_server.url, holder_ttl_s=5, socket_timeout_s=0.5)
    h = Holder("e1", "127.0.0.1:1")
    d.heartbeat(h)
    d.publish([_entry(h, 0)])
    assert d.lookup([(0).to_bytes(16, "big")]) == [_entry(h, 0)]
    redis_server.kill()
    t0 = time.monotonic()
    assert d.lookup([(0).to_bytes(16, "big")]) == [None]
    assert time.monotonic() - t0 < 2 and d.faults == 1


def test_cluster_lookup_is_two_rounds_and_a_dead_master_costs_only_its_keys():
    """On a 3-master Redis Cluster: a batch lookup sends two batches to each master it touches
    (entries, then liveness); with one master killed, the entries the others hold still resolve."""
    with RedisCluster() as cluster:
        d = RedisDirectory(cluster.url, holder_ttl_s=30, socket_timeout_s=0.5)
        holders = [Holder(f"e{i}", f"127.0.0.1:{5000 + i}") for i in range(4)]
        for h in holders:
            d.heartbeat(h)
        entries = [_entry(holders[i % 4], i) for i in range(60)]
        d.publish(entries)
        keys = [e.key for e in entries]
        assert d.lookup(keys) == entries
        sends = Counter()
        original = redis.connection.Connection.send_packed_command

        def counted(self, command, check_health=True):  # noqa: ANN001, ANN202
            sends[self.port] += 1
            return original(self, command, check_health)

        redis.connection.Connection.send_packed_command = counted
        try:
            assert d.lookup(keys) == entries
        finally:
            redis.connection.Connection.send_packed_command = original
        assert sorted(sends) == sorted(n.port for n in cluster.nodes) and set(sends.values()) <= {1, 2}, sends
        assert sum(sends.values()) <= 6
        victim = cluster.nodes[2].port
        holds = d._nodes.node_of
        on_victim = [holds(d._nodes.slot(d._snap(k))).connection_pool.connection_kwargs["port"] == victim
                     for k in keys]
        live_on_victim = {h.engine_id for h in holders
                          if holds(d._nodes.slot(d._live(h.engine_id))).connection_pool.connection_kwargs["port"]
                          == victim}
        os.kill(cluster.nodes[2].proc.pid, signal.SIGSTOP)  # hung: the one deadline bounds the whole lookup
        try:
            t0 = time.monotonic()
            hung = d.lookup(keys)
            assert time.monotonic() - t0 < 1.5 and all(g is None or g == e for g, e in zip(hung, entries))
        finally:
            os.kill(cluster.nodes[2].proc.pid, signal.SIGCONT)
        cluster.nodes[2].kill()
        t0 = time.monotonic()
        got = d.lookup(keys)
        assert time.monotonic() - t0 < 3 and d.faults >= 1
        want = [None if dead or e.holder.engine_id in live_on_victim else e for e, dead in zip(entries, on_victim)]
        assert got == want and any(got)
        d.close()


def test_a_given_redis_cluster_client_takes_the_cluster_path(redis_cluster):
    from kvledger.util.redis_cluster import cluster_client

    d = RedisDirectory(client=cluster_client(redis_cluster.url, 2.0), prefix=f"kvl:test:{uuid.uuid4().hex[:8]}:")
    h = Holder("e1", "127.0.0.1:1")
    d.heartbeat(h)
    d.publish([_entry(h, i) for i in range(20)])
    assert d.lookup([i.to_bytes(16, "big") for i in range(21)]) == [_entry(h, i) for i in range(20)] + [None]
    d.withdraw([(3).to_bytes(16, "big")], h)
    d.retire(h)
    assert d.lookup([(4).to_bytes(16, "big")]) == [None] and d.faults == 0
    d.close()


def test_a_unix_socket_url_publishes_and_looks_up_with_the_same_deadlines(tmp_path):
    """`unix://PATH` (a redis-server listening on a socket in tmp_path): publish, heartbeat and lookup
    work (the deadline connection wraps redis-py's socket-path connection, not only TCP), and a
    caller's `deadline` block still cuts a lookup on a hung server short of `socket_timeout_s`."""
    from kvledger.util.redis_server import RedisServer

    sock = tmp_path / "redis.sock"
    server = RedisServer(extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700")).start(timeout_s=60)
    try:
        d = RedisDirectory(f"unix://{sock}?db=0", prefix="kvl:test:unix:", holder_ttl_s=30, socket_timeout_s=5.0)
        h = Holder("e1", "127.0.0.1:1")
        d.heartbeat(h)
        d.publish([_entry(h, i) for i in range(3)])
        assert d.lookup([i.to_bytes(16, "big") for i in range(4)]) == [_entry(h, i) for i in range(3)] + [None]
        assert d.faults == 0 and d._r.connection_pool.connection_kwargs["path"] == str(sock)
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: only the deadline can end the lookup before 5 s
        try:
            t0 = time.monotonic()
            with deadline(0.3):
                assert d.lookup([(0).to_bytes(16, "big")]) == [None]
            assert time.monotonic() - t0 < 1.5 and d.faults == 1
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        d.close()
    finally:
        server.close()
