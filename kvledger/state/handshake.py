"""Both sides of the state server's connection handshake (frames in `wire.py`, keys in `auth.py`).

    client                                   server
    Hello(cn)                       ──────▶
                                    ◀──────  Challenge(sn, HMAC(K, "server" | cn | sn))
    checks the server's proof; only then
    Proof(HMAC(K, "client" | cn | sn)) + first request ──▶  checks the client's proof

Both then use the session key HMAC(K, "session" | cn | sn). Every wait shares the caller's
`deadline` (monotonic seconds): TimeoutError past it, EOFError when the peer closes.

After the handshake both sides switch the socket to non-blocking (`after_handshake`) and move
requests and answers with `sockio`'s calls.
"""

from __future__ import annotations

import socket
import time

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


def after_handshake(sock: socket.socket) -> None:
    """Make an authenticated connection's socket non-blocking: `sockio`'s calls wait by deadline themselves."""
    sock.setblocking(False)
