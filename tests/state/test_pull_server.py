import contextlib
import hashlib
import os
import socket
import threading
import time

import pytest

from kvledger.state.client import StateClient, parse_address
from kvledger.state.pool import SlotPool, checksum
from kvledger.state import auth
from kvledger.state.wire import (
    CHALLENGE_BYTES,
    HELLO_BYTES,
    PROOF_BYTES,
    REQUEST_BYTES,
    RESPONSE_BYTES,
    Op,
    PullStatus,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_request,
    pack_response,
    unpack_response,
)
from kvledger.state.pull_server import StateServer
from tests.state.raw_frames import handshake, recv_all, recv_exact

SIZE = 1_415_040
TOKEN = "cluster-token"
PULL_S = 10.0  # generous: a loaded machine is slow, not wrong


@pytest.fixture
def served():
    with SlotPool(SIZE, 4) as pool:
        data = {i: os.urandom(SIZE) for i in range(3)}
        for i, d in data.items():
            pool.put(bytes([i]) * 16, 128 * (i + 1), d)
        server = StateServer(pool, TOKEN, io_timeout_s=0.5, idle_timeout_s=2.0, handshake_timeout_s=1.0,
                             max_connections=8).start()
        try:
            yield server, pool, data
        finally:
            server.stop()


def _raw(server: StateServer, frame: bytes, *, half_close: bool = True, timeout: float = 5) -> bytes:
    with socket.create_connection(parse_address(server.address), timeout=timeout) as s:
        s.sendall(frame)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
        return out


def test_pull_hit_miss_ping_and_keepalive(served):
    server, pool, data = served
    with StateClient(TOKEN, timeout_s=PULL_S) as c:
        for _ in range(3):
            for i in range(3):
                assert c.pull(server.address, bytes([i]) * 16) == data[i]
        out = bytearray(SIZE + 100)
        assert c.pull_into(server.address, bytes([2]) * 16, out) == (SIZE, 384) and out[:SIZE] == data[2]
        assert c.pull(server.address, b"\x09" * 16) is None and c.stats["miss"] == 1
        assert c.pull_into(server.address, bytes([0]) * 16, bytearray(SIZE - 1)) is None  # too small a buffer
        assert c.stats["too_big"] == 1
        assert c.ping(server.address)
    assert server.stats.served in (10, 11) and server.stats.misses == 1  # the too-big one may count as sent
    assert server.stats.connections <= 4  # kept-alive connections, not one per pull


def test_wrong_proof_malformed_and_replayed_frames_are_refused(served):
    server, _, data = served
    good = StateClient(TOKEN, timeout_s=PULL_S)
    with socket.create_connection(parse_address(server.address), timeout=5) as s:  # not our protocol
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(64, b"\0"))
        assert recv_all(s) == b""  # closed, nothing said
    with socket.create_connection(parse_address(server.address), timeout=5) as s:  # a guessed proof
        s.sendall(pack_hello(os.urandom(32)))
        recv_exact(s, CHALLENGE_BYTES)
        s.sendall(pack_proof(os.urandom(32)) + os.urandom(1000))  # whatever follows is never read
        answer = recv_all(s)
        assert len(answer) == RESPONSE_BYTES and unpack_response(answer, None, bytes(16)).status is PullStatus.DENIED
    with socket.create_connection(parse_address(server.address), timeout=5) as s:  # a request with a bad MAC
        session, proof = handshake(s, TOKEN)
        frame = bytearray(pack_request(session, Op.GET, 0, bytes([0]) * 16))
        frame[-1] ^= 1
        s.sendall(proof + bytes(frame))
        assert recv_all(s) == b""
    with socket.create_connection(parse_address(server.address), timeout=5) as s:  # a request sent twice
        session, proof = handshake(s, TOKEN)
        frame = pack_request(session, Op.GET, 0, bytes([0]) * 16)
        s.sendall(proof + frame)
        head = recv_exact(s, RESPONSE_BYTES)
        assert unpack_response(head, session, bytes([0]) * 16).status is PullStatus.OK
        assert recv_exact(s, SIZE) == data[0]
        s.sendall(frame)  # replayed within the session: out of sequence
        assert recv_all(s) == b""
    assert server.stats.bad == 3 and server.stats.denied == 1
    assert good.pull(server.address, bytes([0]) * 16) == data[0]
    assert StateClient("guess").pull(server.address, bytes([0]) * 16) is None


def test_a_captured_session_replayed_without_the_token_is_refused(served):
    """Every byte a genuine client sent, captured on the wire and sent again: no snapshot comes back."""
    server, _, data = served
    captured = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as relay:
        def forward() -> None:
            c, _ = relay.accept()
            with c, socket.create_connection(parse_address(server.address)) as up:
                threading.Thread(target=lambda: _pipe(up, c, None), daemon=True).start()
                _pipe(c, up, captured)

        threading.Thread(target=forward, daemon=True).start()
        with StateClient(TOKEN, timeout_s=PULL_S) as c:
            assert c.pull(f"127.0.0.1:{relay.getsockname()[1]}", bytes([1]) * 16) == data[1]
    assert len(captured) == HELLO_BYTES + PROOF_BYTES + REQUEST_BYTES
    with socket.create_connection(parse_address(server.address), timeout=5) as s:
        s.sendall(captured[:HELLO_BYTES])
        recv_exact(s, CHALLENGE_BYTES)  # a fresh server nonce: the captured proof does not fit it
        s.sendall(captured[HELLO_BYTES:])
        answer = recv_all(s)
    assert len(answer) == RESPONSE_BYTES and unpack_response(answer, None, bytes(16)).status is PullStatus.DENIED
    assert data[1][:4096] not in answer and server.stats.denied == 1


def _pipe(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
    with contextlib.suppress(OSError):
        while chunk := src.recv(1 << 16):
            if record is not None:
                record += chunk
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)


def test_a_server_without_the_token_learns_nothing_reusable():
    """A fake holder (say, at an address a forged directory entry names) gets a random nonce, nothing else."""
    seen: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as fake:
        def serve() -> None:
            for _ in range(2):
                conn, _ = fake.accept()
                with conn:
                    seen.append(recv_exact(conn, HELLO_BYTES))
                    conn.sendall(pack_challenge(os.urandom(32), os.urandom(32)))  # it cannot prove the token
                    conn.settimeout(1)
                    seen[-1] += recv_all(conn)

        threading.Thread(target=serve, daemon=True).start()
        with StateClient(TOKEN) as c:
            for _ in range(2):
                assert c.pull(f"127.0.0.1:{fake.getsockname()[1]}", bytes([0]) * 16, 2.0) is None
            assert c.stats["auth"] == 2
    assert [len(x) for x in seen] == [HELLO_BYTES, HELLO_BYTES] and seen[0] != seen[1]  # fresh nonces only
    old_digest = hashlib.sha256(b"kvledger/state-token\x00" + TOKEN.encode()).digest()  # what v1 sent
    secrets = [*auth.derive_keys(TOKEN), TOKEN.encode(), old_digest]
    assert not any(x[:16] in s for s in seen for x in secrets)


def test_a_stalled_handshake_times_out_without_blocking_others(served):
    server, _, data = served
    with socket.create_connection(parse_address(server.address), timeout=5) as slow:
        slow.sendall(b"KVLH")  # and then nothing: slowloris
        t0 = time.monotonic()
        with StateClient(TOKEN, timeout_s=PULL_S) as c:
            assert c.pull(server.address, bytes([1]) * 16) == data[1]  # served meanwhile
        assert slow.recv(100) == b""  # the server closed it after handshake_timeout_s
        assert 0.3 < time.monotonic() - t0 < 3
    deadline = time.monotonic() + 2
    while server.stats.timeouts < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats.timeouts == 1


def _wait_for(cond, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_an_idle_connection_and_a_stalled_request_are_closed_at_their_deadlines(served):
    """After the handshake: a kept-alive connection with no request is closed after `idle_timeout_s` (quietly);
    one whose request stops after its first bytes after `io_timeout_s` (a timeout)."""
    server, _, data = served
    for stall, limit, timeouts in ((b"", server.idle_timeout_s, 0), (b"KVLS\x02", server.io_timeout_s, 1)):
        with socket.create_connection(parse_address(server.address), timeout=10) as s:
            session, proof = handshake(s, TOKEN)
            s.sendall(proof + pack_request(session, Op.GET, 0, bytes([1]) * 16))
            resp = unpack_response(recv_exact(s, RESPONSE_BYTES), session, bytes([1]) * 16)
            assert resp.status is PullStatus.OK and recv_exact(s, resp.length) == data[1]
            t0 = time.monotonic()
            s.sendall(stall)
            assert recv_all(s) == b""   # closed by the server
            assert limit - 0.2 < time.monotonic() - t0 < limit + 2
        assert _wait_for(lambda want=timeouts: server.stats.timeouts == want)


def test_a_reader_that_stops_reading_is_cut_at_the_answer_deadline():
    """An answer that cannot be sent within `io_timeout_s` (the reader stopped reading) ends the connection,
    counted as a timeout, and unpins the slot."""
    with SlotPool(SIZE * 8, 1) as pool:   # 11 MB: more than the socket buffers hold
        key = b"\x01" * 16
        pool.put(key, 128, os.urandom(SIZE * 8))
        server = StateServer(pool, TOKEN, io_timeout_s=0.5).start()
        try:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(10)
            s.connect(parse_address(server.address))
            session, proof = handshake(s, TOKEN)
            t0 = time.monotonic()
            s.sendall(proof + pack_request(session, Op.GET, 0, key))
            assert unpack_response(recv_exact(s, RESPONSE_BYTES), session, key).status is PullStatus.OK
            assert _wait_for(lambda: server.stats.timeouts == 1)   # and then it reads nothing more
            assert 0.4 < time.monotonic() - t0 < 5
            assert pool.pinned_count() == 0 and server.stats.served == 0
            s.close()
        finally:
            server.stop()


def test_idle_unauthenticated_connections_do_not_block_pulls(served):
    """Three times `max_connections` silent connections: a pull is served at once, they are cut."""
    server, _, data = served
    address = parse_address(server.address)
    socks = [socket.create_connection(address, timeout=5) for _ in range(3 * server.max_connections)]
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        with StateClient(TOKEN, timeout_s=PULL_S) as c:
            assert c.pull(server.address, bytes([2]) * 16) == data[2]
        assert time.monotonic() - t0 < server.handshake_timeout_s
        for s in socks:  # closed once the handshake deadline passed, not the idle timeout
            assert recv_all(s) == b""
        assert time.monotonic() - t0 < server.handshake_timeout_s + 1.5
    finally:
        for s in socks:
            s.close()


def test_at_the_cap_the_least_recently_used_idle_connection_makes_room(served):
    """Least recently used: the oldest last request, whatever order the server's threads went back to waiting in."""
    server, _, data = served
    clients = [StateClient(TOKEN, timeout_s=PULL_S) for _ in range(server.max_connections + 1)]
    try:
        for c in clients[:-1]:  # every slot taken by a kept-alive, idle connection
            assert c.pull(server.address, bytes([0]) * 16) == data[0]
        assert _wait_for(lambda: server.idle_connections == server.max_connections)   # every thread back waiting
        assert clients[-1].pull(server.address, bytes([1]) * 16) == data[1]  # one more: room is made
        assert server.stats.evicted == 1 and server.stats.busy == 0
        assert _wait_for(lambda: server.idle_connections == server.max_connections)   # every thread back waiting
        assert clients[0].pull(server.address, bytes([2]) * 16) == data[2]  # the evicted one reconnects
        assert clients[0].stats["hit"] == 2 and server.stats.evicted == 2  # ... in its turn evicting the LRU
    finally:
        for c in clients:
            c.close()


def test_when_every_connection_is_busy_a_client_backs_off_and_gets_in(served):
    server, _, data = served
    busy = []
    t_busy = time.monotonic()   # no busy connection's io_timeout_s runs out before t_busy + io_timeout_s
    for _ in range(server.max_connections):  # authenticated, each in the middle of a request
        s = socket.create_connection(parse_address(server.address), timeout=5)
        session, proof = handshake(s, TOKEN)
        s.sendall(proof + pack_request(session, Op.PING, 0)[:1])
        busy.append(s)
    try:
        time.sleep(0.1)
        with StateClient(TOKEN) as c:
            assert c.pull(server.address, bytes([1]) * 16, 0.2) is None and server.stats.busy >= 1
            # answered BUSY, it backs off and retries until the deadline: the last try ends BUSY,
            # or, on a loaded machine, runs out of time in the middle of its handshake
            assert c.stats["busy"] + c.stats["timeout"] == 1 and c.stats["hit"] == 0
            t0 = time.monotonic()  # the busy ones time out after io_timeout_s (0.5 s): then it gets in
            assert c.pull(server.address, bytes([1]) * 16, 3.0) == data[1]
            assert time.monotonic() - t_busy > server.io_timeout_s and time.monotonic() - t0 < 2.0
        assert server.stats.busy >= 2 and server.stats.evicted == 0
    finally:
        for s in busy:
            s.close()


def test_an_empty_token_is_refused_at_start():
    with SlotPool(SIZE, 1) as pool:
        for make in (lambda: StateServer(pool, ""), lambda: StateClient(b"")):
            with pytest.raises(ValueError, match="token is empty"):
                make()


def test_a_slot_being_sent_is_not_evicted_under_the_reader():
    """A slow reader holds the pin while the server sends; concurrent puts evict only other slots."""
    with SlotPool(SIZE * 4, 2) as pool:  # 5.4 MB snapshots: more than the socket buffers hold
        big = os.urandom(SIZE * 4)
        pool.put(b"\x01" * 16, 128, big)
        server = StateServer(pool, TOKEN, io_timeout_s=10).start()
        try:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader: a small window
            s.settimeout(10)
            s.connect(parse_address(server.address))
            session, proof = handshake(s, TOKEN)
            s.sendall(proof + pack_request(session, Op.GET, 0, b"\x01" * 16))
            head = recv_exact(s, RESPONSE_BYTES)
            assert unpack_response(head, session, b"\x01" * 16).status is PullStatus.OK
            deadline = time.monotonic() + 5
            while pool.pinned_count() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.pinned_count() == 1  # the server is still sending out of the slot
            for i in range(5):  # churn the other slot; the pinned one must survive
                assert pool.put(bytes([10 + i]) * 16, 128, os.urandom(16)).evicted != [b"\x01" * 16]
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # now read it all
            got = bytearray()
            while len(got) < len(big) and (chunk := s.recv(1 << 20)):
                got += chunk
            assert got == big
            s.close()
        finally:
            server.stop()


def test_stop_cuts_a_pull_in_flight_into_a_miss():
    with SlotPool(SIZE, 1) as pool:
        pool.put(b"\x01" * 16, 128, os.urandom(SIZE))
        server = StateServer(pool, TOKEN).start()
        address = server.address
        with StateClient(TOKEN) as c:
            assert c.pull(address, b"\x01" * 16) is not None
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            stopper.join(10)
            assert not stopper.is_alive()
            t0 = time.monotonic()
            assert c.pull(address, b"\x01" * 16, 1.0) is None  # kept connection dead, then refused
            assert time.monotonic() - t0 < 1.0


def test_client_faults_are_misses():
    with StateClient(TOKEN, timeout_s=0.5) as c:
        assert c.pull("not-an-address", b"\x00" * 16) is None
        assert c.pull("127.0.0.1:1", b"\x00" * 16) is None  # nothing listens: refused
        assert c.stats["unreachable"] == 2
        # a listener that accepts and never answers: a timeout
        with socket.create_server(("127.0.0.1", 0)) as mute:
            t0 = time.monotonic()
            assert c.pull(f"127.0.0.1:{mute.getsockname()[1]}", b"\x00" * 16) is None
            assert 0.4 < time.monotonic() - t0 < 1.5 and c.stats["timeout"] == 1
        # a listener that answers garbage: a protocol fault
        with socket.create_server(("127.0.0.1", 0)) as liar:
            def lie() -> None:
                conn, _ = liar.accept()
                conn.recv(HELLO_BYTES)
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 100)
                time.sleep(0.5)
                conn.close()

            threading.Thread(target=lie, daemon=True).start()
            assert c.pull(f"127.0.0.1:{liar.getsockname()[1]}", b"\x00" * 16) is None
            assert c.stats["protocol"] == 1


def test_a_corrupted_transfer_is_a_miss():
    """A holder that knows the token, whose bytes do not match the checksum it announces (broken memory)."""
    key = b"\x00" * 16
    with socket.create_server(("127.0.0.1", 0)) as bad:
        def serve() -> None:
            conn, _ = bad.accept()
            hk = auth.derive_keys(TOKEN).handshake
            cn, sn = recv_exact(conn, HELLO_BYTES)[8:], os.urandom(32)
            conn.sendall(pack_challenge(sn, auth.server_proof(hk, cn, sn)))
            recv_exact(conn, PROOF_BYTES + REQUEST_BYTES)
            session = auth.session_key(hk, cn, sn)
            conn.sendall(pack_response(session, PullStatus.OK, 0, key, 100, 128, 12345) + os.urandom(100))
            time.sleep(0.5)
            conn.close()

        threading.Thread(target=serve, daemon=True).start()
        with StateClient(TOKEN) as c:
            assert c.pull(f"127.0.0.1:{bad.getsockname()[1]}", key) is None
            assert c.stats["corrupt"] == 1


def _lying_holder(listener: socket.socket, key: bytes, data: bytes, announced: int, pieces: int) -> None:
    """A holder that knows the token and answers one GET with `data` under the checksum `announced`, sent in
    `pieces` pieces with pauses between them (so the client reads and checks it across many receives)."""
    conn, _ = listener.accept()
    hk = auth.derive_keys(TOKEN).handshake
    cn, sn = recv_exact(conn, HELLO_BYTES)[8:], os.urandom(32)
    conn.sendall(pack_challenge(sn, auth.server_proof(hk, cn, sn)))
    recv_exact(conn, PROOF_BYTES + REQUEST_BYTES)
    session = auth.session_key(hk, cn, sn)
    conn.sendall(pack_response(session, PullStatus.OK, 0, key, len(data), 128, announced))
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        conn.sendall(data[i:i + step])
        time.sleep(0.01)
    time.sleep(0.5)
    conn.close()


@pytest.mark.parametrize("flip", [None, 0, 77_777, SIZE - 1])   # intact; a byte changed in the first, a middle
def test_a_snapshot_arriving_in_pieces_is_checked_across_all_of_them(flip):   # and the last piece
    """The client checksums each piece as it lands: intact bytes in any pieces are a hit, byte for byte; one
    changed byte anywhere is a miss ("corrupt")."""
    key, data = b"\x05" * 16, os.urandom(SIZE)
    sent = bytearray(data)
    if flip is not None:
        sent[flip] ^= 0xFF
    with socket.create_server(("127.0.0.1", 0)) as holder:
        threading.Thread(target=_lying_holder, args=(holder, key, bytes(sent), checksum(data), 13),
                         daemon=True).start()
        with StateClient(TOKEN) as c:
            out = bytearray(SIZE + 100)
            got = c.pull_into(f"127.0.0.1:{holder.getsockname()[1]}", key, out, PULL_S)
            if flip is None:
                assert got is not None and got.size == SIZE and out[:SIZE] == data and c.stats["hit"] == 1
            else:
                assert got is None and c.stats["corrupt"] == 1


def test_bytes_that_change_in_the_slot_while_it_is_sent_are_a_miss():
    """A slot whose bytes change after the server pinned it (a writer that broke the pin, broken memory) is sent
    with the checksum taken at `put`: the puller's check catches it (a miss, never the changed bytes)."""
    with SlotPool(SIZE, 2) as pool:
        key, data = b"\x06" * 16, os.urandom(SIZE)
        pool.put(key, 128, data)
        real_pin = pool.pin

        def pin_then_change(k: bytes):
            pinned = real_pin(k)
            pinned.view[SIZE // 2] ^= 0xFF   # in place, in the shared segment the server sends from
            return pinned

        pool.pin = pin_then_change
        server = StateServer(pool, TOKEN).start()
        try:
            with StateClient(TOKEN) as c:
                assert c.pull(server.address, key, PULL_S) is None
                assert c.stats["corrupt"] == 1 and c.stats["hit"] == 0
        finally:
            server.stop()


def test_module_level_pull(served):
    from kvledger.state import pull

    server, _, data = served
    assert pull(server.address, bytes([1]) * 16, 2.0, token=TOKEN) == data[1]
    assert pull(server.address, bytes([1]) * 16, 2.0, token="wrong") is None
    assert pull(server.address, b"\x07" * 16, 2.0, token=TOKEN) is None
