"""Keys and MACs of the cluster's internal APIs, all derived from the cluster token, which is never sent.

    root      = SHA-256("kvledger/state-token\\0" || token)
    handshake = HMAC-SHA256(root, "handshake")   proofs and session keys of the state server
    directory = HMAC-SHA256(root, "directory")   MACs of directory entries
    registry  = HMAC-SHA256(root, "registry")    MACs of engine registry entries (engine/engine_registry.py)
    engine    = HMAC-SHA256(root, "engine")      proofs and session keys of an engine's internal API
    trace     = HMAC-SHA256(root, "trace")       the key of the trace's hash ids (entrypoint/trace_recorder.py):
                                                 every entrypoint of a cluster writes the same ids

A state-server connection (and an engine API session, engine/session.py) proves the token both
ways over fresh 32-byte nonces from both sides (see `wire.py`): nothing on the wire can be
replayed on another connection, and a peer that does not know the token learns only random nonces
and MACs it cannot reuse. Every MAC is
HMAC-SHA256 (32 B), compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, NamedTuple

NONCE_BYTES = 32
MAC_BYTES = 32
_CONTEXT = b"kvledger/state-token\x00"


class Keys(NamedTuple):
    handshake: bytes  # 32 B
    directory: bytes  # 32 B
    registry: bytes   # 32 B
    engine: bytes     # 32 B
    trace: bytes      # 32 B


def derive_keys(token: str | bytes) -> Keys:
    """The keys of a cluster token; ValueError for an empty one (it would let anyone in)."""
    raw = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not raw:
        raise ValueError("the cluster token is empty: give every state server and client the same "
                         "non-empty secret token")
    root = hashlib.sha256(_CONTEXT + raw).digest()
    return Keys(*(mac(root, name.encode()) for name in Keys._fields))


def mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenated parts (callers use fixed-size or length-prefixed parts)."""
    return hmac.digest(key, b"".join(parts), "sha256")


def keyed(key: bytes) -> Any:
    """HMAC-SHA256 keyed once, for many MACs under one key (a connection's frames): `h = k.copy(); h.update(...);
    h.digest()` is `mac(key, ...)`, at a third of its cost for a 72-byte frame (the padded key's inner and outer
    states are hashed once, not per MAC). It is the standard library's C object behind `hmac.HMAC` (its `_hmac`,
    OpenSSL's HMAC) where there is one, else that wrapper, which has the same three methods at five interpreter
    calls more per MAC. `tests/state/test_wire.py` checks it against `hmac.digest`."""
    h = hmac.new(key, digestmod="sha256")
    return getattr(h, "_hmac", None) or h


same = hmac.compare_digest   # MACs compared in constant time: the C function itself, one interpreter call less


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(key, b"server", client_nonce, server_nonce)


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(key, b"client", client_nonce, server_nonce)


def session_key(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The key of one connection's request and answer MACs (never sent)."""
    return mac(key, b"session", client_nonce, server_nonce)
