"""A state connection's socket calls (`kvledger.state.sockio`), each case run on the C calls and on their Python
twins: every byte in order whether the first call takes it all or the buffer fills, the count short only when the
peer closed, the digest fed every byte, the deadline kept, a signal's handler run at once."""

import signal
import socket
import threading
import time

import pytest
import xxhash

from kvledger.state import sockio
from kvledger.state.handshake import after_handshake

IMPLS = {"python": (sockio.py_send_all, sockio.py_recv_some, sockio.py_recvmsg_some, sockio.py_recv_fill)}
if sockio.COMPILED:
    from kvledger.state import _sockio

    IMPLS["c"] = (_sockio.send_all, _sockio.recv_some, _sockio.recvmsg_some, _sockio.recv_fill)


@pytest.fixture(params=sorted(IMPLS))
def io(request):
    return IMPLS[request.param]


def test_the_c_calls_are_used_where_they_were_built():
    assert (sockio.send_all is sockio.py_send_all) is not sockio.COMPILED


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    after_handshake(a)
    after_handshake(b)
    return a, b


def _read_all(recv_some, sock: socket.socket, n: int, out: bytearray, pause_s: float = 0.0) -> None:
    view, got = memoryview(bytearray(n)), 0
    while got < n:
        got += recv_some(sock, view[got:], time.monotonic() + 10)
        time.sleep(pause_s)   # a slow reader: the sender's buffer fills
    out += view


def test_one_call_takes_small_buffers_whole(io):
    send_all, recv_some, _, _ = io
    a, b = _pair()
    with a, b:
        payload = bytearray(range(256)) * 4
        send_all(a, [b"head", memoryview(payload)[:1000], b""], time.monotonic() + 1)
        out = bytearray()
        _read_all(recv_some, b, 1004, out)
        assert out == b"head" + payload[:1000]


def test_a_full_send_buffer_sends_the_rest_in_order_as_room_comes(io):
    send_all, recv_some, _, _ = io
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with a, b:
        payload = bytes(i * 7 % 251 for i in range(3 << 20))   # far over the send buffer
        buffers = [b"x" * 72, memoryview(payload)[:1 << 20], payload[1 << 20:]]
        out = bytearray()
        reader = threading.Thread(target=_read_all, args=(recv_some, b, 72 + len(payload), out, 0.0005))
        reader.start()
        send_all(a, buffers, time.monotonic() + 30)
        reader.join(30)
        assert bytes(out) == b"x" * 72 + payload


def test_a_peer_that_stops_reading_is_a_timeout_at_the_deadline(io):
    send_all = io[0]
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with a, b:
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            send_all(a, [bytes(8 << 20)], t + 0.3)
        assert 0.3 <= time.monotonic() - t < 2.0


def test_a_closed_peer_is_an_os_error_when_sending(io):
    send_all = io[0]
    a, b = _pair()
    with a:
        b.close()
        with pytest.raises(OSError):
            send_all(a, [bytes(1 << 20)], time.monotonic() + 2)


def test_a_closed_socket_is_an_os_error(io):
    send_all, recv_some, recvmsg_some, recv_fill = io
    a, b = _pair()
    a.close()
    with b:
        deadline = time.monotonic() + 1
        for call in (lambda: send_all(a, [b"x"], deadline), lambda: recv_some(a, bytearray(8), deadline),
                     lambda: recvmsg_some(a, [bytearray(8)], deadline), lambda: recv_fill(a, bytearray(8), deadline)):
            with pytest.raises(OSError):
                call()


def test_recv_fill_feeds_the_digest_every_byte_as_it_lands(io):
    send_all, _, _, recv_fill = io
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with a, b:
        payload = bytes(i * 13 % 241 for i in range(1 << 20))
        sender = threading.Thread(target=send_all, args=(a, [payload], time.monotonic() + 30))
        sender.start()
        out, digest = bytearray(len(payload)), xxhash.xxh3_64()
        assert recv_fill(b, memoryview(out), time.monotonic() + 30, digest) == len(payload)
        sender.join(30)
        assert out == payload and digest.intdigest() == xxhash.xxh3_64_intdigest(payload)


def test_recv_fill_is_short_only_when_the_peer_closed(io):
    _, _, _, recv_fill = io
    a, b = _pair()
    with b:
        a.sendall(b"12345")
        a.close()
        out = bytearray(10)
        assert recv_fill(b, out, time.monotonic() + 2) == 5 and out[:5] == b"12345"
        assert recv_fill(b, bytearray(0), time.monotonic() + 2) == 0


def test_receiving_nothing_is_a_timeout_at_the_deadline(io):
    _, recv_some, recvmsg_some, recv_fill = io
    a, b = _pair()
    with a, b:
        for call in (lambda d: recv_some(b, bytearray(8), d, False), lambda d: recv_some(b, bytearray(8), d),
                     lambda d: recvmsg_some(b, [bytearray(4), bytearray(4)], d),
                     lambda d: recv_fill(b, bytearray(8), d)):
            t = time.monotonic()
            with pytest.raises(TimeoutError):
                call(t + 0.2)
            assert 0.2 <= time.monotonic() - t < 1.5


def test_one_scatter_read_fills_the_buffers_in_order_and_reads_zero_at_eof(io):
    _, _, recvmsg_some, _ = io
    a, b = _pair()
    with b:
        a.sendall(b"headbody!")
        head, body = bytearray(4), bytearray(16)
        assert recvmsg_some(b, [head, memoryview(body)], time.monotonic() + 2) == 9
        assert head == b"head" and body[:5] == b"body!"
        a.close()
        assert recvmsg_some(b, [head], time.monotonic() + 2) == 0


def test_a_signal_while_waiting_runs_its_handler_at_once(io):
    _, recv_some, _, _ = io

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    a, b = _pair()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        with a, b:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            t = time.monotonic()
            with pytest.raises(Interrupted):
                recv_some(b, bytearray(8), t + 10, False)   # Ctrl-C is the same: the wait ends
            assert time.monotonic() - t < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
