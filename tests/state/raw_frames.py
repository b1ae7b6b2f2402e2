"""Raw protocol moves for tests that speak to a state server frame by frame."""

from __future__ import annotations

import socket

from kvledger.state import auth
from kvledger.state.wire import (
    CHALLENGE_BYTES,
    PullStatus,
    pack_hello,
    pack_proof,
    unpack_challenge,
)


def recv_all(sock: socket.socket) -> bytes:
    """Everything until the peer closes (a reset counts as closed)."""
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return out


def handshake(sock: socket.socket, token: str) -> tuple[bytes, bytes]:
    """Run the client side with `token`: (session key, the proof frame to send before the first request)."""
    key = auth.derive_keys(token).handshake
    cn = auth.nonce()
    sock.sendall(pack_hello(cn))
    status, sn, proof = unpack_challenge(recv_exact(sock, CHALLENGE_BYTES))
    assert status is PullStatus.OK and auth.same(proof, auth.server_proof(key, cn, sn))
    return auth.session_key(key, cn, sn), pack_proof(auth.client_proof(key, cn, sn))
