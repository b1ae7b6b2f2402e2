"""Faults between processes: real state servers in separate processes (in separate network
namespaces where the machine allows), a real redis-server, SIGKILL and SIGSTOP."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

from kvledger.core import ModelSpec
from kvledger.state import RedisDirectory, StateClient, StateLedger
from kvledger.state.wire import (RESPONSE_BYTES, Op, PullStatus, pack_hello, pack_proof, pack_request,
                                     unpack_response)
from tests.state.helpers import digest, snap_bytes, snap_key
from tests.state.raw_frames import handshake, recv_all, recv_exact

SIZE = ModelSpec.preset("deepseek-v4.1-flash").state_size_to_disk()


def _exchange(a, b) -> None:
    for i in range(3):
        got_by_a = a.ask(f"pull {b.address} 2 {i} {SIZE}")
        got_by_b = b.ask(f"pull {a.address} 1 {i} {SIZE}")
        assert got_by_a["ok"] and got_by_a["digest"] == digest(snap_bytes(2, i, SIZE))
        assert got_by_b["ok"] and got_by_b["digest"] == digest(snap_bytes(1, i, SIZE))
    # a key the other side never had is an orderly miss, not a fault
    miss = a.ask(f"pull {b.address} 1 0 {SIZE}")
    assert not miss["ok"] and miss["cause"] == ["miss"]


def test_two_servers_exchange_snapshots_byte_exactly(spawn_holder, netns_pair):
    """In two network namespaces where the machine allows it, else on two loopback ports."""
    token = uuid.uuid4().hex
    a_net, b_net = netns_pair
    if a_net is None:
        print(f"state exchange over two loopback ports ({b_net})")
        a = spawn_holder(token=token, seed=1, count=3)
        b = spawn_holder(token=token, seed=2, count=3)
    else:
        print(f"state exchange across network namespaces {a_net[0]} ({a_net[1]}) and {b_net[0]} ({b_net[1]})")
        a = spawn_holder(token=token, seed=1, count=3, netns=a_net[0], host=a_net[1])
        b = spawn_holder(token=token, seed=2, count=3, netns=b_net[0], host=b_net[1])
        assert a.address.startswith(a_net[1]) and b.address.startswith(b_net[1])
    _exchange(a, b)


def test_two_servers_exchange_snapshots_on_loopback_ports(spawn_holder):
    """The fallback path, run everywhere."""
    token = uuid.uuid4().hex
    a = spawn_holder(token=token, seed=1, count=3)
    b = spawn_holder(token=token, seed=2, count=3)
    assert a.address.startswith("127.0.0.1:") and b.address.startswith("127.0.0.1:") and a.address != b.address
    _exchange(a, b)


def test_holder_killed_in_the_middle_of_a_pull_is_a_miss_within_the_timeout(spawn_holder):
    token = uuid.uuid4().hex
    size = 48 << 20  # a big snapshot: one pull takes tens of ms, so the kill lands inside one
    h = spawn_holder(token=token, seed=3, count=1, size=size)
    expected = snap_bytes(3, 0, size)
    client = StateClient(token)
    timeout = 3.0
    results: list[tuple[float, float, bool | None]] = []  # (start, end, exact bytes? / None: miss)
    in_flight = [0.0]  # start of the pull in progress (0: none)

    def puller() -> None:
        out = bytearray(size)
        while True:
            t0 = in_flight[0] = time.monotonic()
            got = client.pull_into(h.address, snap_key(3, 0), out, timeout)
            in_flight[0] = 0.0
            results.append((t0, time.monotonic(), out == expected if got is not None else None))
            if got is None:
                return

    thread = threading.Thread(target=puller, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    killed_at = None
    while killed_at is None and time.monotonic() < deadline:  # a few whole pulls, then one stopped mid-answer
        started = in_flight[0]
        if len(results) >= 3 and started and time.monotonic() - started > 0.002:
            # stopped first: a pull whose answer had left the holder whole (in the socket buffers) still finishes,
            # exactly, and then the kill would meet the next pull instead; only one still waiting is killed under
            os.kill(h.proc.pid, signal.SIGSTOP)
            _wait_stopped(h.proc.pid)
            time.sleep(0.05)
            if in_flight[0] == started:
                killed_at = time.monotonic()
                os.kill(h.proc.pid, signal.SIGKILL)
            else:
                os.kill(h.proc.pid, signal.SIGCONT)
        time.sleep(0.0005)
    assert killed_at is not None, "no pull was caught mid-answer"
    thread.join(timeout + 2)
    assert not thread.is_alive(), "a pull hung past its timeout"
    assert len(results) >= 4
    last_start, last_end, last = results[-1]
    assert last is None  # the pull that met the kill is a miss ...
    assert last_start < killed_at  # ... it was in flight when the holder died ...
    assert last_end - killed_at < timeout  # ... and it ended within the timeout (EOF/RST comes at once)
    assert all(r[2] is True for r in results[:-1])  # every pull before it was byte-exact
    causes = {k for k in client.stats if k != "hit"}
    # EOF or reset mid-answer; or, when no byte of the answer had come yet, the one retry on a
    # new connection is refused by the dead holder
    assert causes and causes <= {"eof", "reset", "unreachable"}, client.stats
    # the dead holder stays a miss, quickly: connection refused
    t0 = time.monotonic()
    assert client.pull(h.address, snap_key(3, 0), timeout) is None
    assert time.monotonic() - t0 < timeout


def _wait_stopped(pid: int) -> None:
    """A signal is delivered asynchronously: wait until every thread of `pid` is stopped."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
        if all(st in "tT" for st in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def test_hung_holder_is_a_miss_after_the_timeout_not_a_hang(spawn_holder):
    token = uuid.uuid4().hex
    h = spawn_holder(token=token, seed=4, count=1)
    client = StateClient(token)
    assert client.pull(h.address, snap_key(4, 0), 2.0) == snap_bytes(4, 0, SIZE)
    os.kill(h.proc.pid, signal.SIGSTOP)
    _wait_stopped(h.proc.pid)
    try:
        t0 = time.monotonic()
        assert client.pull(h.address, snap_key(4, 0), 0.5) is None
        elapsed = time.monotonic() - t0
        assert 0.4 < elapsed < 1.5, elapsed
        assert client.stats["timeout"] == 1
    finally:
        os.kill(h.proc.pid, signal.SIGCONT)
    # it woke up: the next pull (on a fresh connection) is a hit again
    assert client.pull(h.address, snap_key(4, 0), 5.0) == snap_bytes(4, 0, SIZE)


def test_dead_holders_directory_entries_expire(spawn_holder, redis_server):
    token = uuid.uuid4().hex
    ttl = 1.0
    h = spawn_holder(token=token, seed=5, count=2, redis_url=redis_server.url, holder_ttl=ttl, engine_id="e1")
    directory = RedisDirectory(redis_server.url, holder_ttl_s=ttl)
    keys = [snap_key(5, 0), snap_key(5, 1)]
    spec = ModelSpec.preset("deepseek-v4.1-flash")
    with StateLedger(spec, token=token, directory=directory, capacity_bytes=0) as entry:
        assert entry.positions(keys) == {128, 256}
        assert entry.fetch(keys[1]) == snap_bytes(5, 1, SIZE)  # pulled from the holder process
        time.sleep(2 * ttl)  # heartbeats keep it alive past its TTL
        assert entry.positions(keys) == {128, 256}
        os.kill(h.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while entry.positions(keys) and time.monotonic() - killed < 10 * ttl:
            time.sleep(0.05)
        assert entry.positions(keys) == set()
        assert time.monotonic() - killed <= ttl + 0.5  # gone within one TTL (+ scheduling slack)
        assert directory.lookup(keys) == [None, None]
        assert entry.fetch(keys[0]) is None  # and a fetch is a miss, not an error
    # the entries themselves carry a server-side TTL, so they do not point at nothing forever
    raw = directory._r
    assert all(raw.pttl(directory._snap(k)) > 0 for k in keys)


def test_bad_requests_are_refused_and_the_server_keeps_serving(spawn_holder):
    token = uuid.uuid4().hex
    h = spawn_holder(token=token, seed=6, count=1)
    host, port = h.address.rsplit(":", 1)
    good = StateClient(token)
    assert good.pull(h.address, snap_key(6, 0)) == snap_bytes(6, 0, SIZE)

    def raw(token: str | None, tamper: bool = False) -> bytes:
        """A handshake (`token` None: a guessed proof) and one GET, maybe with a changed byte."""
        with socket.create_connection((host, int(port)), timeout=5) as s:
            if token is None:
                s.sendall(pack_hello(os.urandom(32)))
                recv_exact(s, 72)
                session, proof = os.urandom(32), pack_proof(os.urandom(32))
            else:
                session, proof = handshake(s, token)
            frame = bytearray(pack_request(session, Op.GET, 0, snap_key(6, 0)))
            frame[20] ^= tamper
            s.sendall(proof + bytes(frame))
            s.shutdown(socket.SHUT_WR)
            return recv_all(s)

    denied = raw(None)  # refused, nothing leaked
    assert len(denied) == RESPONSE_BYTES and unpack_response(denied, None, bytes(16)).status is PullStatus.DENIED
    assert raw(token, tamper=True) == b""  # a changed request: closed unanswered
    with socket.create_connection((host, int(port)), timeout=5) as s:  # not our protocol at all
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(64, b"\0"))
        assert recv_all(s) == b""
    assert len(raw(token)) == RESPONSE_BYTES + SIZE  # the same frame, untouched, is served
    assert good.pull(h.address, snap_key(6, 0)) == snap_bytes(6, 0, SIZE)  # still serving
    assert StateClient("not-the-token").pull(h.address, snap_key(6, 0)) is None
