"""Keys and MACs of the cluster's internal APIs, all derived from the cluster token, which is never sent.

    root      = SHA-256("kvledger/state-token\\0" || token)
    handshake = HMAC-SHA256(root, "handshake")   proofs and session keys of the state server
    directory = HMAC-SHA256(root, "directory")   MACs of directory entries
    registry  = HMAC-SHA256(root, "registry")    MACs of engine registry entries (engine/engine_registry.py)
    engine    = HMAC-SHA256(root, "engine")      proofs and session keys of an engine's internal API

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
from typing import NamedTuple

NONCE_BYTES = 32
MAC_BYTES = 32
_CONTEXT = b"kvledger/state-token\x00"


class Keys(NamedTuple):
    handshake: bytes  # 32 B
    directory: bytes  # 32 B
    registry: bytes   # 32 B
    engine: bytes     # 32 B


def derive_keys(token: str | bytes) -> Keys:
    """The keys of a cluster token; ValueError for an empty one (it would let anyone in)."""
    raw = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not raw:
        raise ValueError("the cluster token is empty: give every state server and client the same "
                         "non-empty secret token")
    root = hashlib.sha256(_CONTEXT + raw).digest()
    return Keys(*(mac(root, name.encode()) for name in Keys._fields))


def mac(key: bytes | Keyed, *parts: bytes | bytearray | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenated parts (callers use fixed-size or length-prefixed parts)."""
    if isinstance(key, Keyed):
        return key.mac(*parts)
    return hmac.digest(key, b"".join(parts), "sha256")


class Keyed:
    """A key made ready for many MACs (a session's frames): `Keyed(k).mac(*parts) == mac(k, *parts)`.

    HMAC-SHA256 keyed once (its inner and outer padded-key states): each MAC copies that state instead of keying
    an HMAC from scratch (a third of the cost of `hmac.digest` for a 72-byte frame). The copy, updates and digest
    go to the standard library's C object behind `hmac.HMAC` (its `_hmac`, OpenSSL's HMAC) when there is one: the
    Python wrapper around it costs five interpreter calls a MAC, four MACs a pull on a cold cache
    (docs/state.md). `tests/state/test_wire.py` checks it against `hmac.digest`."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        h = hmac.new(key, digestmod="sha256")
        self._keyed = getattr(h, "_hmac", None) or h   # the same copy/update/digest either way

    def mac(self, *parts: bytes | bytearray | memoryview) -> bytes:
        h = self._keyed.copy()
        for part in parts:
            h.update(part)
        return h.digest()

    def __repr__(self) -> str:
        return "Keyed(<secret>)"


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
