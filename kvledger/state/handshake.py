"""Both sides of the state server's connection handshake (frames in `wire.py`, keys in `auth.py`).

    client                                   server
    Hello(cn)                       ──────▶
                                    ◀──────  Challenge(sn, HMAC(K, "server" | cn | sn))
    checks the server's proof; only then
    Proof(HMAC(K, "client" | cn | sn)) + first request ──▶  checks the client's proof

Both then use the session key HMAC(K, "session" | cn | sn). Every wait shares the caller's
`deadline` (monotonic seconds): TimeoutError past it, EOFError when the peer closes.

After the handshake both sides switch the socket to non-blocking (`after_handshake`) and move
requests and answers with `send_all`, `recv_some` and `recvmsg_some`: each call is tried at once
and only one that would block waits in poll() for what is left of its deadline. Python's own
socket timeouts poll before every call and switch the descriptor's mode (an ioctl) at every
`settimeout`: on a pull that was six system calls on the server where three do now.
"""

from __future__ import annotations

import math
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

from kvledger.state import auth
from kvledger.state.wire import (
    CHALLENGE_BYTES,
    HELLO_BYTES,
    PROOF_BYTES,
    ProtocolError,
    PullStatus,
    pack_challenge,
    pack_hello,
    pack_proof,
    unpack_challenge,
    unpack_hello,
    unpack_proof,
)


class Refused(Exception):
    """The handshake failed on the peer's side: `cause` is "protocol" (not our frames), "auth"
    (the server's proof is wrong), "denied" (the client's proof is wrong), "busy" or "bad"."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def settimeout(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    sock.settimeout(remaining)


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes before `deadline`."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        settimeout(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def open_session(sock: socket.socket, key: bytes, deadline: float) -> tuple[bytes, bytes]:
    """Client side: (session key, the proof frame to send with the first request), once the
    server proved the token. A server that cannot gets a random nonce and nothing else."""
    client_nonce = auth.nonce()
    settimeout(sock, deadline)
    sock.sendall(pack_hello(client_nonce))
    try:
        status, server_nonce, proof = unpack_challenge(recv_exact(sock, CHALLENGE_BYTES, deadline))
    except ProtocolError:
        raise Refused("protocol") from None
    if status is not PullStatus.OK:
        raise Refused("busy" if status is PullStatus.BUSY else "bad")
    if not auth.same(proof, auth.server_proof(key, client_nonce, server_nonce)):
        raise Refused("auth")
    return (auth.session_key(key, client_nonce, server_nonce),
            pack_proof(auth.client_proof(key, client_nonce, server_nonce)))


def accept_session(sock: socket.socket, key: bytes, deadline: float) -> bytes:
    """Server side: the session key once the client proved the token."""
    try:
        client_nonce = unpack_hello(recv_exact(sock, HELLO_BYTES, deadline))
        server_nonce = auth.nonce()
        settimeout(sock, deadline)
        sock.sendall(pack_challenge(server_nonce, auth.server_proof(key, client_nonce, server_nonce)))
        proof = unpack_proof(recv_exact(sock, PROOF_BYTES, deadline))
    except ProtocolError:
        raise Refused("protocol") from None
    if not auth.same(proof, auth.client_proof(key, client_nonce, server_nonce)):
        raise Refused("denied")
    return auth.session_key(key, client_nonce, server_nonce)


# --- after the handshake: non-blocking calls, one deadline per exchange ---------------------------

def after_handshake(sock: socket.socket) -> None:
    """Make an authenticated connection's socket non-blocking: the calls below wait by deadline themselves."""
    sock.setblocking(False)


def wait_for(sock: socket.socket, events: int, deadline: float) -> None:
    """Return once `sock` is ready for `events` (select.POLLIN / POLLOUT), has an error or was hung up
    (the next call reports which); TimeoutError at `deadline`."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    poller = select.poll()
    poller.register(sock, events)
    if not poller.poll(math.ceil(remaining * 1000)):
        raise TimeoutError


def send_all(sock: socket.socket, buffers: Sequence[Any], deadline: float) -> None:
    """Send every byte of `buffers` in order (sendmsg: straight out of them, no copy) before `deadline`.
    Each buffer is bytes or a one-dimensional byte view (its len is its size in bytes)."""
    try:   # the common case: one call takes everything, with no views made
        n = sock.sendmsg(buffers)
    except BlockingIOError:
        n = 0
    if n == sum(map(len, buffers)):
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        while views and n >= views[0].nbytes:
            n -= views.pop(0).nbytes
        if n:
            views[0] = views[0][n:]
        if not views:
            return
        wait_for(sock, select.POLLOUT, deadline)   # the send buffer is full: wait for room
        try:
            n = sock.sendmsg(views)
        except BlockingIOError:
            n = 0


def recv_some(sock: socket.socket, view: memoryview, deadline: float, *, ready: bool = True) -> int:
    """Receive what has arrived into `view` (at least one byte; 0 when the peer closed) before `deadline`.
    `ready=False`: nothing is expected to have arrived yet, so wait first rather than try first."""
    if not ready:
        wait_for(sock, select.POLLIN, deadline)
    while True:
        try:
            return sock.recv_into(view)
        except BlockingIOError:
            wait_for(sock, select.POLLIN, deadline)


def recvmsg_some(sock: socket.socket, buffers: list[Any], deadline: float) -> int:
    """One scatter read into `buffers` (what has arrived, at least one byte; 0 when the peer closed), waiting
    first: it is the read of an answer just asked for."""
    while True:
        wait_for(sock, select.POLLIN, deadline)
        try:
            return sock.recvmsg_into(buffers)[0]
        except BlockingIOError:
            continue
