import contextlib
import os
import socket
import threading
import time

import pytest

from kvledger.state.client import StateClient, parse_address
from kvledger.state.pool import SlotPool
from kvledger.state.protocol import REQUEST_BYTES, Op, Status, pack_request, token_digest, unpack_response
from kvledger.state.server import StateServer

SIZE = 1_415_040
TOKEN = "cluster-token"


@pytest.fixture
def served():
    with SlotPool(SIZE, 4) as pool:
        data = {i: os.urandom(SIZE) for i in range(3)}
        for i, d in data.items():
            pool.put(bytes([i]) * 16, 128 * (i + 1), d)
        server = StateServer(pool, TOKEN, io_timeout_s=0.5, idle_timeout_s=2.0, max_connections=8).start()
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
    with StateClient(TOKEN) as c:
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


def test_wrong_token_malformed_and_absurd_frames_are_refused(served):
    server, _, data = served
    good = StateClient(TOKEN)
    frame = pack_request(Op.GET, token_digest(TOKEN), bytes([0]) * 16)
    absurd = bytearray(frame)
    absurd[56:60] = (2**32 - 1).to_bytes(4, "little")
    cases = {
        "wrong token": (pack_request(Op.GET, token_digest("guess"), bytes([0]) * 16), Status.DENIED),
        "absurd length": (bytes(absurd), Status.BAD),
        "bad magic": (b"\x00" * REQUEST_BYTES, Status.BAD),
        "unknown op": (frame[:5] + b"\x77" + frame[6:], Status.BAD),
        "bad version": (frame[:4] + b"\x02" + frame[5:], Status.BAD),
    }
    for name, (raw, status) in cases.items():
        answer = _raw(server, raw + os.urandom(1000))  # whatever follows is never read as a body
        assert len(answer) == 40 and unpack_response(answer).status is status, name
        assert good.pull(server.address, bytes([0]) * 16) == data[0], name
    assert server.stats.denied == 1 and server.stats.bad == 4
    assert StateClient("guess").pull(server.address, bytes([0]) * 16) is None
    assert _raw(server, frame[:30]) == b""  # a short frame then EOF: closed, nothing sent


def test_a_stalled_header_times_out_without_blocking_others(served):
    server, _, data = served
    with socket.create_connection(parse_address(server.address), timeout=5) as slow:
        slow.sendall(b"KVLS")  # and then nothing: slowloris
        t0 = time.monotonic()
        with StateClient(TOKEN) as c:
            assert c.pull(server.address, bytes([1]) * 16) == data[1]  # served meanwhile
        assert slow.recv(100) == b""  # the server closed it after io_timeout_s
        assert 0.3 < time.monotonic() - t0 < 3
    deadline = time.monotonic() + 2
    while server.stats.timeouts < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats.timeouts == 1


def test_connections_over_the_limit_are_refused_and_idle_ones_closed(served):
    server, _, data = served
    socks = [socket.create_connection(parse_address(server.address), timeout=5) for _ in range(8)]
    try:
        time.sleep(0.2)
        with socket.create_connection(parse_address(server.address), timeout=5) as extra:
            extra.sendall(pack_request(Op.PING, token_digest(TOKEN)))
            # refused: closed without an answer (EOF, or a reset since our request was never read)
            with contextlib.suppress(ConnectionResetError):
                assert extra.recv(100) == b""
        assert server.stats.refused >= 1
        for s in socks:  # the idle ones are closed after idle_timeout_s (2 s)
            s.settimeout(5)
            assert s.recv(100) == b""
    finally:
        for s in socks:
            s.close()
    time.sleep(0.1)
    with StateClient(TOKEN) as c:
        assert c.pull(server.address, bytes([2]) * 16) == data[2]


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
            s.sendall(pack_request(Op.GET, token_digest(TOKEN), b"\x01" * 16))
            head = s.recv(40, socket.MSG_WAITALL)
            assert unpack_response(head).status is Status.OK
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
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 100)
                time.sleep(0.5)
                conn.close()

            threading.Thread(target=lie, daemon=True).start()
            assert c.pull(f"127.0.0.1:{liar.getsockname()[1]}", b"\x00" * 16) is None
            assert c.stats["protocol"] == 1


def test_a_corrupted_transfer_is_a_miss():
    """A server whose bytes do not match the checksum it announces (a lying or broken holder)."""
    from kvledger.state.protocol import pack_response

    with socket.create_server(("127.0.0.1", 0)) as bad:
        def serve() -> None:
            conn, _ = bad.accept()
            conn.recv(64)
            conn.sendall(pack_response(Status.OK, 100, 128, 12345) + os.urandom(100))
            time.sleep(0.5)
            conn.close()

        threading.Thread(target=serve, daemon=True).start()
        with StateClient(TOKEN) as c:
            assert c.pull(f"127.0.0.1:{bad.getsockname()[1]}", b"\x00" * 16) is None
            assert c.stats["corrupt"] == 1


def test_module_level_pull(served):
    from kvledger.state import pull

    server, _, data = served
    assert pull(server.address, bytes([1]) * 16, 2.0, token=TOKEN) == data[1]
    assert pull(server.address, bytes([1]) * 16, 2.0, token="wrong") is None
    assert pull(server.address, b"\x07" * 16, 2.0, token=TOKEN) is None
