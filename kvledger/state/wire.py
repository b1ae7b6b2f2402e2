"""The state server's wire format: fixed-size binary frames, raw payload bytes, nothing else.

A connection opens with a mutual challenge–response, then carries any number of requests,
each answered in order. Keys are from `auth.py` (K = the token's handshake key, never sent):

  Hello     (40 B) C→S  magic "KVLH" | version u8 | reserved u8 | reserved u16 | client nonce 32 B
  Challenge (72 B) S→C  magic "KVLC" | version u8 | status u8 | reserved u16 | server nonce 32 B
                        | server proof 32 B            proof = HMAC(K, "server" | cn | sn)
  Proof     (40 B) C→S  magic "KVLP" | version u8 | reserved u8 | reserved u16 | client proof 32 B
                        (sent together with the first request)   = HMAC(K, "client" | cn | sn)
  Request   (64 B) C→S  magic "KVLS" | version u8 | op u8 | reserved u16 | seq u64 | key 16 B
                        | mac 32 B                     mac = HMAC(S, bytes 0..31 of the frame)
  PullResponse  (72 B) S→C  magic "KVLR" | version u8 | status u8 | reserved u16 | seq u64 | length u64
                        | position u64 | checksum u64 | mac 32 B, then `length` payload bytes
                                                       mac = HMAC(S, bytes 0..39 | request key)

S = HMAC(K, "session" | cn | sn), one per connection (each side keys it once: `Session`).
The client checks the server's proof before it sends its own, so a server without the token
learns only a random nonce. `seq` counts the connection's requests from 0: a request or answer
that is replayed, reordered or injected fails its MAC or its seq. The answer's MAC binds its
header and `checksum` (xxh3-64 of the payload, computed once when the snapshot was stored) to
the session and the key; the payload itself is checked against that checksum (MACing 1.4 MB
per pull would cost more than the copy). A DENIED answer (wrong proof) carries a zero MAC:
there is no shared session.

All integers little-endian. `length` above `MAX_PAYLOAD` is refused before a byte of it is
read. No pickle, no code-executing format: a frame is parsed by `struct` and nothing else.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

from kvledger.core import KEY_BYTES
from kvledger.state.auth import MAC_BYTES, NONCE_BYTES, keyed, same

MAGIC_HELLO = b"KVLH"
MAGIC_CHALLENGE = b"KVLC"
MAGIC_PROOF = b"KVLP"
MAGIC_REQUEST = b"KVLS"
MAGIC_RESPONSE = b"KVLR"
VERSION = 2
MAX_PAYLOAD = 64 << 20  # bytes; a snapshot of any preset is < 2 MiB, so 64 MiB is absurd already

_HELLO = struct.Struct(f"<4sBBH{NONCE_BYTES}s")
_CHALLENGE = struct.Struct(f"<4sBBH{NONCE_BYTES}s{MAC_BYTES}s")
_REQUEST_HEAD = struct.Struct(f"<4sBBHQ{KEY_BYTES}s")
_RESPONSE_HEAD = struct.Struct("<4sBBHQQQQ")
HELLO_BYTES = PROOF_BYTES = _HELLO.size
CHALLENGE_BYTES = _CHALLENGE.size
REQUEST_BYTES = _REQUEST_HEAD.size + MAC_BYTES
RESPONSE_BYTES = _RESPONSE_HEAD.size + MAC_BYTES
assert (HELLO_BYTES, CHALLENGE_BYTES, REQUEST_BYTES, RESPONSE_BYTES) == (40, 72, 64, 72)
_ZERO_MAC = bytes(MAC_BYTES)


class Op(IntEnum):
    PING = 1  # liveness: answers OK with no payload
    GET = 2   # pull one snapshot by key


class PullStatus(IntEnum):
    OK = 0
    MISS = 1     # no such snapshot (never stored, evicted, or not yet committed)
    DENIED = 2   # wrong proof; the server closes the connection
    BAD = 3      # malformed frame, bad MAC or seq; the server closes the connection
    BUSY = 4     # authenticated, but every connection slot is busy: back off, retry on a new connection


_OPS = {int(op): op for op in Op}
_STATUSES = {int(status): status for status in PullStatus}


class ProtocolError(ValueError):
    """A frame that is not a valid kvledger state frame (wrong magic, version, op, length or MAC)."""


class PullRequest(NamedTuple):
    op: Op
    seq: int
    key: bytes


class PullResponse(NamedTuple):
    status: PullStatus
    seq: int
    length: int
    position: int
    checksum: int


def _check_magic(magic: bytes, version: int, want: bytes) -> None:
    if magic != want:
        raise ProtocolError("bad magic")
    if version != VERSION:
        raise ProtocolError(f"unsupported version {version}")


# --- handshake -------------------------------------------------------------------------

def pack_hello(client_nonce: bytes) -> bytes:
    return _HELLO.pack(MAGIC_HELLO, VERSION, 0, 0, client_nonce)


def unpack_hello(frame: bytes | bytearray | memoryview) -> bytes:
    """The client nonce of a 40-byte Hello; `ProtocolError` otherwise."""
    if len(frame) != HELLO_BYTES:
        raise ProtocolError(f"hello is {len(frame)} B, expected {HELLO_BYTES}")
    magic, version, _, _, client_nonce = _HELLO.unpack(frame)
    _check_magic(magic, version, MAGIC_HELLO)
    return client_nonce


def pack_challenge(server_nonce: bytes, proof: bytes, status: PullStatus = PullStatus.OK) -> bytes:
    return _CHALLENGE.pack(MAGIC_CHALLENGE, VERSION, int(status), 0, server_nonce, proof)


def unpack_challenge(frame: bytes | bytearray | memoryview) -> tuple[PullStatus, bytes, bytes]:
    """(status, server nonce, server proof) of a 72-byte Challenge; `ProtocolError` otherwise."""
    if len(frame) != CHALLENGE_BYTES:
        raise ProtocolError(f"challenge is {len(frame)} B, expected {CHALLENGE_BYTES}")
    magic, version, status, _, server_nonce, proof = _CHALLENGE.unpack(frame)
    _check_magic(magic, version, MAGIC_CHALLENGE)
    try:
        return PullStatus(status), server_nonce, proof
    except ValueError:
        raise ProtocolError(f"unknown status {status}") from None


def pack_proof(proof: bytes) -> bytes:
    assert len(proof) == MAC_BYTES
    return _HELLO.pack(MAGIC_PROOF, VERSION, 0, 0, proof)


def unpack_proof(frame: bytes | bytearray | memoryview) -> bytes:
    if len(frame) != PROOF_BYTES:
        raise ProtocolError(f"proof is {len(frame)} B, expected {PROOF_BYTES}")
    magic, version, _, _, proof = _HELLO.unpack(frame)
    _check_magic(magic, version, MAGIC_PROOF)
    return proof


# --- requests and answers --------------------------------------------------------------

class Session:
    """The request and answer frames of one authenticated connection, under its session key S.

    HMAC-SHA256 keyed once (`auth.keyed`): each frame copies the keyed state instead of keying from scratch, and
    packs, MACs and checks in one interpreter call (a pull's four frame calls are on its critical path, after a
    1.4 MB copy has evicted the interpreter from the cache: docs/state.md). The module functions below are the
    same frames for a key given per call."""

    __slots__ = ("_hmac",)

    def __init__(self, key: bytes) -> None:
        self._hmac = keyed(key)

    def request(self, op: Op, seq: int, key: bytes) -> bytes:
        assert len(key) == KEY_BYTES and 0 <= seq < 2**64
        head = _REQUEST_HEAD.pack(MAGIC_REQUEST, VERSION, op, 0, seq, key)
        h = self._hmac.copy()
        h.update(head)
        return head + h.digest()

    def read_request(self, frame: bytes | bytearray | memoryview) -> tuple[Op, int, bytes]:
        """(op, seq, key) of an authentic 64-byte request; `ProtocolError` for anything else."""
        if len(frame) != REQUEST_BYTES:
            raise ProtocolError(f"request is {len(frame)} B, expected {REQUEST_BYTES}")
        magic, version, op, _, seq, key = _REQUEST_HEAD.unpack_from(frame)
        view = memoryview(frame)
        h = self._hmac.copy()
        h.update(view[:_REQUEST_HEAD.size])
        if not same(h.digest(), view[_REQUEST_HEAD.size:]):
            raise ProtocolError("bad request MAC")
        if magic != MAGIC_REQUEST or version != VERSION:   # _check_magic's test, inline: one call less a pull
            _check_magic(magic, version, MAGIC_REQUEST)
        known = _OPS.get(op)
        if known is None:
            raise ProtocolError(f"unknown op {op}")
        return known, seq, key

    def answer(self, status: PullStatus, seq: int, key: bytes, length: int = 0, position: int = 0,
               checksum: int = 0) -> bytes:
        """The answer to request `seq` for `key` (any status but DENIED, which has no session)."""
        assert 0 <= length <= MAX_PAYLOAD and (status is PullStatus.OK or length == 0)
        assert status is not PullStatus.DENIED
        head = _RESPONSE_HEAD.pack(MAGIC_RESPONSE, VERSION, status, 0, seq, length, position, checksum)
        h = self._hmac.copy()
        h.update(head)
        h.update(key)
        return head + h.digest()

    def read_answer(self, frame: bytes | bytearray | memoryview, key: bytes) -> PullResponse:
        """A 72-byte answer to a request for `key`, its MAC checked unless it is DENIED (which ends the connection
        either way); `ProtocolError` otherwise."""
        resp = _parse_response(frame)
        if resp.status is not PullStatus.DENIED:
            view = memoryview(frame)
            h = self._hmac.copy()
            h.update(view[:_RESPONSE_HEAD.size])
            h.update(key)
            if not same(h.digest(), view[_RESPONSE_HEAD.size:]):
                raise ProtocolError("bad response MAC")
        return resp

    def __repr__(self) -> str:
        return "Session(<secret>)"


def _session(session: bytes | Session) -> Session:
    return session if isinstance(session, Session) else Session(session)


def _parse_response(frame: bytes | bytearray | memoryview) -> PullResponse:
    """The fields of a 72-byte answer, its MAC not checked; `ProtocolError` for a frame that is not one."""
    if len(frame) != RESPONSE_BYTES:
        raise ProtocolError(f"response is {len(frame)} B, expected {RESPONSE_BYTES}")
    magic, version, code, _, seq, length, position, checksum = _RESPONSE_HEAD.unpack_from(frame)
    if magic != MAGIC_RESPONSE or version != VERSION:   # _check_magic's test, inline: one call less a pull
        _check_magic(magic, version, MAGIC_RESPONSE)
    status = _STATUSES.get(code)
    if status is None:
        raise ProtocolError(f"unknown status {code}")
    if length > MAX_PAYLOAD or (status is not PullStatus.OK and length):
        raise ProtocolError(f"absurd length {length} for status {status.name}")
    return PullResponse(status, seq, length, position, checksum)


def pack_request(session: bytes | Session, op: Op, seq: int, key: bytes = bytes(KEY_BYTES)) -> bytes:
    return _session(session).request(op, seq, key)


def unpack_request(frame: bytes | bytearray | memoryview, session: bytes | Session) -> PullRequest:
    """Parse and authenticate a 64-byte request; `ProtocolError` for anything else."""
    return PullRequest(*_session(session).read_request(frame))


def pack_response(session: bytes | Session | None, status: PullStatus, seq: int, key: bytes, length: int = 0,
                  position: int = 0, checksum: int = 0) -> bytes:
    """An answer to request `seq` for `key`; `session` None (no MAC) only for DENIED."""
    assert (session is None) == (status is PullStatus.DENIED)
    if session is None:
        return _RESPONSE_HEAD.pack(MAGIC_RESPONSE, VERSION, status, 0, seq, length, position, checksum) + _ZERO_MAC
    return _session(session).answer(status, seq, key, length, position, checksum)


def unpack_response(frame: bytes | bytearray | memoryview, session: bytes | Session | None, key: bytes) -> PullResponse:
    """Parse a 72-byte answer to a request for `key`; its MAC is checked unless it is DENIED
    (which ends the connection either way) or `session` is None. `ProtocolError` otherwise."""
    if session is None:
        return _parse_response(frame)
    return _session(session).read_answer(frame, key)
