"""On-disk format of a segment: the blocks of one put call in one file, metadata first.

    [header 64 B][namespace][ttl class][entries n × 56 B]            immutable, covered by meta_xxh
    [expiry n × f64][last_hit n × f64][flags n × u8]                  mutable, rewritten in place
    [zero padding to a 4096-byte boundary = data_off]
    [block 0][block 1]...                                             each covered by its entry's xxh3-64

A segment is written under a temporary name, fsynced and renamed, so it exists whole or not
at all. Blocks are stored in chain order, so GC removes a chain's tail by truncating the
file; an entry whose bytes lie past the end of the file is gone. The mutable arrays are not
checksummed: a value outside its sane range is clamped (expiry ≤ created + ttl → created + ttl,
a flag other than 0 → dead), which can shorten a block's life but never serve wrong bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvledger.store.backend import ChainWrite, read_name, stored_name

MAGIC = b"KVLSEG01"
VERSION = 1
# magic, version, n, ns_len, cls_len, reserved, ttl_s, created, data_off, meta_xxh
HEADER = struct.Struct("<8sIIHHIddQQ")
ENTRY = struct.Struct("<16s16sIIQQ")      # key, parent, pos, size, xxh3_64, offset
HEADER_BYTES = 64
ALIGN = 4096
SUFFIX = ".kvs"
FLAG_LIVE = 0  # a flag other than this: the block is dead (the retired scan store wrote 1)
assert HEADER.size <= HEADER_BYTES and ENTRY.size == 56


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets of the regions of a segment with `n` entries."""

    n: int
    entries_off: int
    expiry_off: int
    hits_off: int
    flags_off: int
    data_off: int

    @classmethod
    def of(cls, n: int, ns_len: int, cls_len: int) -> Layout:
        entries_off = _align(HEADER_BYTES + ns_len + cls_len, 8)
        expiry_off = entries_off + n * ENTRY.size
        hits_off = expiry_off + 8 * n
        flags_off = hits_off + 8 * n
        return cls(n, entries_off, expiry_off, hits_off, flags_off, _align(flags_off + n, ALIGN))


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def encode_meta(namespace: str, ttl_class: str, ttl_s: float, created: float,
                entries: list[tuple[bytes, bytes, int, int, int, int]], expiry: list[float]) -> bytes:
    """The metadata prefix of a segment (everything before data_off); entries are ENTRY tuples."""
    ns, cl = stored_name(namespace), stored_name(ttl_class)
    assert len(ns) < 2**16 and len(cl) < 2**16, "stored_name bounds every name"
    lay = Layout.of(len(entries), len(ns), len(cl))
    buf = bytearray(lay.data_off)
    buf[HEADER_BYTES:HEADER_BYTES + len(ns) + len(cl)] = ns + cl
    for i, e in enumerate(entries):
        ENTRY.pack_into(buf, lay.entries_off + i * ENTRY.size, *e)
    struct.pack_into(f"<{len(expiry)}d", buf, lay.expiry_off, *expiry)
    struct.pack_into(f"<{len(expiry)}d", buf, lay.hits_off, *([created] * len(expiry)))
    head = HEADER.pack(MAGIC, VERSION, len(entries), len(ns), len(cl), 0, ttl_s, created, lay.data_off, 0)
    meta_xxh = xxhash.xxh3_64_intdigest(head[:-8] + bytes(buf[HEADER_BYTES:lay.expiry_off]))
    buf[:HEADER.size] = head[:-8] + struct.pack("<Q", meta_xxh)
    return bytes(buf)


def data_offset(write: ChainWrite, n: int) -> int:
    """Where the first block's bytes start in a segment of `n` blocks of `write` (`Layout.data_off`)."""
    return Layout.of(n, len(stored_name(write.namespace)), len(stored_name(write.ttl_class))).data_off


def encode_chain(write: ChainWrite, sel: Sequence[int], views: Sequence[memoryview], now: float,
                 xxhs: Sequence[int] | None = None) -> tuple[bytes, list[tuple[bytes, bytes, int, int, int, int]], int]:
    """One segment of the blocks `sel` of `write` (in chain order, their bytes `views`, their xxh3-64 `xxhs` when
    the caller hashed them already), written at `now`: its metadata prefix, its ENTRY rows (key, parent, chain
    position, size, xxh3-64, offset) and its file size. The one encoder of a segment for every store that writes
    them (LMDB's and the shared mount's)."""
    offset = data_offset(write, len(sel))
    if xxhs is None:
        xxhs = [xxhash.xxh3_64_intdigest(v) for v in views]
    rows = []
    for i, v, xxh in zip(sel, views, xxhs):
        parent = write.keys[i - 1] if i > 0 else write.parent
        rows.append((write.keys[i], parent, write.start_pos + i, v.nbytes, xxh, offset))
        offset += v.nbytes
    meta = encode_meta(write.namespace, write.ttl_class, write.ttl_s, now, rows, [now + write.ttl_s] * len(rows))
    return meta, rows, offset

@dataclass(frozen=True, slots=True)
class SegmentMeta:
    namespace: str
    ttl_class: str
    ttl_s: float
    created: float
    layout: Layout
    entries: list[tuple[bytes, bytes, int, int, int, int]]
    expiry: tuple[float, ...]
    last_hit: tuple[float, ...]
    flags: bytes


class BadSegment(Exception):
    """The segment's metadata is unreadable or fails its checksum."""


def read_meta(fd: int) -> SegmentMeta:
    """Parse a segment's metadata from an open file; `BadSegment` when it does not check out."""
    pread = os.pread
    head = pread(fd, HEADER_BYTES, 0)
    if len(head) < HEADER.size:
        raise BadSegment("short header")
    magic, version, n, ns_len, cls_len, _, ttl_s, created, data_off, meta_xxh = HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise BadSegment("bad magic or version")
    lay = Layout.of(n, ns_len, cls_len)
    if lay.data_off != data_off:
        raise BadSegment("bad layout")
    meta = pread(fd, lay.data_off - HEADER_BYTES, HEADER_BYTES)
    if len(meta) < lay.data_off - HEADER_BYTES:
        raise BadSegment("short metadata")
    im_end = lay.expiry_off - HEADER_BYTES
    if xxhash.xxh3_64_intdigest(head[:HEADER.size - 8] + meta[:im_end]) != meta_xxh:
        raise BadSegment("metadata checksum mismatch")
    names = meta[:ns_len + cls_len]
    try:
        namespace, ttl_class = read_name(names[:ns_len]), read_name(names[ns_len:])
    except UnicodeDecodeError:
        raise BadSegment("bad names") from None
    e0 = lay.entries_off - HEADER_BYTES
    entries = list(ENTRY.iter_unpack(meta[e0:e0 + n * ENTRY.size]))
    x0 = lay.expiry_off - HEADER_BYTES
    expiry = struct.unpack_from(f"<{n}d", meta, x0)
    hits = struct.unpack_from(f"<{n}d", meta, x0 + 8 * n)
    flags = meta[x0 + 16 * n:x0 + 17 * n]
    return SegmentMeta(namespace, ttl_class, ttl_s, created, lay, entries, expiry, hits, flags)
