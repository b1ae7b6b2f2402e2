"""The non-blocking calls after the handshake (`handshake.send_all`, `recv_some`): every byte in order, whether the
first `sendmsg` takes it all or the send buffer fills, and a deadline when the peer stops reading."""

import socket
import threading
import time

import pytest

from kvledger.state.handshake import after_handshake, recv_some, send_all


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    after_handshake(a)
    after_handshake(b)
    return a, b


def _read_all(sock: socket.socket, n: int, out: bytearray, pause_s: float = 0.0) -> None:
    view, got = memoryview(bytearray(n)), 0
    while got < n:
        got += recv_some(sock, view[got:], time.monotonic() + 10)
        time.sleep(pause_s)   # a slow reader: the sender's buffer fills
    out += view


def test_one_call_takes_small_buffers_whole():
    a, b = _pair()
    with a, b:
        payload = bytearray(range(256)) * 4
        send_all(a, [b"head", memoryview(payload)[:1000]], time.monotonic() + 1)
        out = bytearray()
        _read_all(b, 1004, out)
        assert out == b"head" + payload[:1000]


def test_a_full_send_buffer_sends_the_rest_in_order_as_room_comes():
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with a, b:
        payload = bytes(i * 7 % 251 for i in range(3 << 20))   # far over the send buffer
        buffers = [b"x" * 72, memoryview(payload)[:1 << 20], payload[1 << 20:]]
        out = bytearray()
        reader = threading.Thread(target=_read_all, args=(b, 72 + len(payload), out, 0.0005))
        reader.start()
        send_all(a, buffers, time.monotonic() + 30)
        reader.join(30)
        assert bytes(out) == b"x" * 72 + payload


def test_a_peer_that_stops_reading_is_a_timeout_at_the_deadline():
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with a, b:
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            send_all(a, [bytes(8 << 20)], t + 0.3)
        assert 0.3 <= time.monotonic() - t < 2.0
