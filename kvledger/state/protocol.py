"""The state server's wire format: fixed-size binary headers, raw payload bytes, nothing else.

Request  (64 B): magic "KVLS" | version u8 | op u8 | reserved u16 | token digest 32 B | key 16 B | length u32 | pad u32
Response (40 B): magic "KVLR" | version u8 | status u8 | reserved u16 | length u64 | position u64 | checksum u64
                 | pad u64, then `length` payload bytes (only when status is OK).

All integers little-endian. The token travels as SHA-256 of the cluster token (fixed length,
compared with `hmac.compare_digest`). `length` is the request body (0 for every op there is
today) or the snapshot size; any length above `MAX_PAYLOAD` is refused before a byte of it is
read. `checksum` is the xxh3-64 of the payload, computed once when the snapshot was stored.
No pickle, no code-executing format: a frame is parsed by `struct` and nothing else.
"""

from __future__ import annotations

import hashlib
import struct
from enum import IntEnum
from typing import NamedTuple

from kvledger.core import KEY_BYTES

MAGIC_REQUEST = b"KVLS"
MAGIC_RESPONSE = b"KVLR"
VERSION = 1
MAX_PAYLOAD = 64 << 20  # bytes; a snapshot of any preset is < 2 MiB, so 64 MiB is absurd already
TOKEN_DIGEST_BYTES = 32

_REQUEST = struct.Struct(f"<4sBBH{TOKEN_DIGEST_BYTES}s{KEY_BYTES}sII")
_RESPONSE = struct.Struct("<4sBBHQQQQ")
REQUEST_BYTES = _REQUEST.size
RESPONSE_BYTES = _RESPONSE.size
assert (REQUEST_BYTES, RESPONSE_BYTES) == (64, 40)


class Op(IntEnum):
    PING = 1  # liveness: answers OK with no payload
    GET = 2   # pull one snapshot by key


class Status(IntEnum):
    OK = 0
    MISS = 1     # no such snapshot (never stored, evicted, or not yet committed)
    DENIED = 2   # wrong cluster token; the server closes the connection
    BAD = 3      # malformed frame or absurd length; the server closes the connection


class ProtocolError(ValueError):
    """A frame that is not a valid kvledger state frame (wrong magic, version, op, or length)."""


class Request(NamedTuple):
    op: Op
    token_digest: bytes
    key: bytes
    length: int


class Response(NamedTuple):
    status: Status
    length: int
    position: int
    checksum: int


def token_digest(token: str | bytes) -> bytes:
    """What a request carries for the cluster token: its SHA-256 (32 B, any token length)."""
    raw = token.encode("utf-8") if isinstance(token, str) else token
    return hashlib.sha256(b"kvledger/state-token\x00" + raw).digest()


def pack_request(op: Op, digest: bytes, key: bytes = bytes(KEY_BYTES), length: int = 0) -> bytes:
    assert len(digest) == TOKEN_DIGEST_BYTES and len(key) == KEY_BYTES and 0 <= length <= MAX_PAYLOAD
    return _REQUEST.pack(MAGIC_REQUEST, VERSION, int(op), 0, digest, key, length, 0)


def unpack_request(frame: bytes | bytearray | memoryview) -> Request:
    """Parse a 64-byte request header; `ProtocolError` for anything that is not a valid one."""
    if len(frame) != REQUEST_BYTES:
        raise ProtocolError(f"request header is {len(frame)} B, expected {REQUEST_BYTES}")
    magic, version, op, _, digest, key, length, _ = _REQUEST.unpack(frame)
    if magic != MAGIC_REQUEST:
        raise ProtocolError("bad magic")
    if version != VERSION:
        raise ProtocolError(f"unsupported version {version}")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"length {length} exceeds {MAX_PAYLOAD}")
    if length != 0:  # no op carries a body today
        raise ProtocolError(f"op {op.name} carries no body, got length {length}")
    return Request(op, digest, key, length)


def pack_response(status: Status, length: int = 0, position: int = 0, checksum: int = 0) -> bytes:
    assert 0 <= length <= MAX_PAYLOAD and (status is Status.OK or length == 0)
    return _RESPONSE.pack(MAGIC_RESPONSE, VERSION, int(status), 0, length, position, checksum, 0)


def unpack_response(frame: bytes | bytearray | memoryview) -> Response:
    """Parse a 40-byte response header; `ProtocolError` for anything that is not a valid one."""
    if len(frame) != RESPONSE_BYTES:
        raise ProtocolError(f"response header is {len(frame)} B, expected {RESPONSE_BYTES}")
    magic, version, status, _, length, position, checksum, _ = _RESPONSE.unpack(frame)
    if magic != MAGIC_RESPONSE or version != VERSION:
        raise ProtocolError("bad magic or version")
    try:
        status = Status(status)
    except ValueError:
        raise ProtocolError(f"unknown status {status}") from None
    if length > MAX_PAYLOAD or (status is not Status.OK and length):
        raise ProtocolError(f"absurd length {length} for status {status.name}")
    return Response(status, length, position, checksum)
