"""The block-store protocol and its records.

A block store holds whole blocks of KV bytes by chain key (16 bytes, `kvledger.core.chain_keys`)
together with the metadata CHECK and GC need: size, xxh3-64 checksum, namespace, TTL class,
expiry, last hit, chain position and parent key. Two stores implement the protocol, opened by
`open.open_block_store`: `LmdbStore` (a directory: segment files and a persisted LMDB index, the
embedded store) and `RedisStore` (a Redis server or Redis Cluster: the shared index, with the bytes
in Redis or in segment files on a shared mount, the cluster mode).

Fault rule (DESIGN.md rule 8): no method raises into the caller for a storage fault. A
missing, expired, corrupt or truncated block is a miss (counted in `counters`); a full disk
or an unreachable server makes `put` return `failed` and `match` answer 0.

Tombstones: a block a store removes (its TTL ran out, or it went for room or as damaged) leaves a small
record of when and why, bounded, so that `match_explained` can say why the first absent block of a
prompt is absent without keeping its bytes (`Gone`; see each store for its bounds).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvledger.core import KEY_BYTES
from kvledger.core.attribution import MissCause
from kvledger.core.keys import namespace_bytes

if TYPE_CHECKING:
    from kvledger.store.forget import Forgotten

Buffer = Any  # anything with the writable/readable buffer protocol: bytearray, memoryview, numpy array
Dest = Any    # where `get_into` reads one block: a writable Buffer, or a tuple of them (its parts, filled in order:
#               the engine's layers, so a block goes straight into its device blocks; `segment_files.dest_parts`)
MISS = -1        # a get_into result: absent, expired, or proven damaged (checksum, short read of a present file)
UNREADABLE = -2  # a get_into result: a local read error (EIO, ENOTCONN, ESTALE...): this machine's problem,
                 # never proof that a shared block is bad (rule 8), so nothing is removed for it
MAX_NAME_BYTES = 1024  # a namespace or class name is stored (for stats) in at most this many bytes


def stored_name(name: str) -> bytes:
    """The bytes a store records for a namespace or TTL class name (stats only: keys carry the full name).

    Any str is accepted (lone surrogates pass through as in `chain_keys`). A name longer than
    MAX_NAME_BYTES is recorded as its first characters, '…' and a SHA-256 digest of the whole:
    distinct names stay distinct, and a put never fails on a long name."""
    raw = namespace_bytes(name)
    if len(raw) <= MAX_NAME_BYTES:
        return raw
    digest = "…#" + hashlib.sha256(raw).hexdigest()[:32]
    head = name[:(MAX_NAME_BYTES - 64) // 4]
    return namespace_bytes(head + digest)


def probe_folder(path: os.PathLike) -> str | None:
    """`BlockStore.probe` of a store kept in the folder `path`."""
    try:
        os.stat(path)
    except OSError as e:
        return f"{path} does not answer ({e.strerror})"
    return None


def read_name(raw: bytes) -> str:
    """The inverse of `stored_name` for names that fit (`UnicodeDecodeError` on bytes that are not one)."""
    return raw.decode("utf-8", "surrogatepass")


def shown_name(raw: bytes) -> str:
    """`read_name`, or for bytes that are not a stored name (an index written before names were stored whole
    or digested: cut at MAX_NAME_BYTES) the same bytes decoded with replacement characters."""
    try:
        return read_name(raw)
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace")


@dataclass(slots=True)
class Counters:
    """Events since the store was opened (this process only)."""

    blocks_written: int = 0
    blocks_skipped: int = 0       # already present (idempotent puts)
    bytes_written: int = 0
    put_failures: int = 0         # put calls that failed soft (disk full, server unreachable, ...)
    blocks_read: int = 0
    bytes_read: int = 0
    misses_absent: int = 0        # get of a key the store does not hold (expired, collected, never written)
    misses_corrupt: int = 0       # checksum mismatch on read
    misses_truncated: int = 0     # short read: file truncated or removed under us
    misses_unreadable: int = 0    # a local read error (the block may be fine elsewhere: kept)
    match_failures: int = 0       # CHECKs that answered 0 because the store was unreachable
    exists_failures: int = 0      # exists calls that answered "absent" because the store was unreachable
    gc_expired: int = 0
    gc_evicted: int = 0
    quota_overrides: int = 0      # blocks evicted within a guarantee: every owner was within its own (over-subscribed)
    blocks_refused: int = 0       # not stored: their tenant is held after a forget (store/forget.py)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Gone:
    """Why a block the store held is absent now, from its tombstone.

    `cause`: `MissCause.EXPIRED` (its TTL ran out; `at` is its expiry) or `MissCause.EVICTED` (removed
    before its expiry: for room, or as damaged; `at` is the removal, or where the store cannot know it,
    the moment it was found gone). `at`: epoch seconds."""

    cause: MissCause
    at: float


@dataclass(frozen=True, slots=True)
class Match:
    """A CHECK's answer with its reason: `blocks` leading keys present (what `match` answers) and, when
    blocks < len(keys), the tombstone of keys[blocks] (None: never stored, tombstone dropped by its
    bound, or a fault)."""

    blocks: int
    gone: Gone | None = None


class PutResult(NamedTuple):
    written: int   # blocks newly stored by this call
    skipped: int   # blocks that were already present
    failed: int    # blocks not stored because of a fault (logged and counted)


class GcResult(NamedTuple):
    expired: int       # blocks removed because their TTL ran out
    evicted: int       # blocks removed to get under the capacity limit
    freed_bytes: int
    batches: int


class VerifyResult(NamedTuple):
    checked: int
    bad: int           # checksum mismatch, truncated, or unreadable
    removed: int
    bytes_checked: int


@dataclass(slots=True)
class StoreStats:
    backend: str
    location: str
    blocks: int = 0
    chains: int = 0                  # chain tails: live blocks that are no live block's parent
    live_bytes: int = 0              # bytes of live blocks
    disk_bytes: int = 0              # bytes the store occupies (file backend: segment files)
    capacity_bytes: int | None = None
    per_class: dict[str, int] = field(default_factory=dict)       # live blocks per TTL class
    per_namespace: dict[str, int] = field(default_factory=dict)   # live blocks per namespace (salted ones apart)
    namespace_bytes: dict[str, int] = field(default_factory=dict)  # live bytes per tenant namespace (salts in it)
    class_bytes: dict[str, int] = field(default_factory=dict)      # live bytes per TTL class
    guarantees: dict[str, dict[str, int]] = field(default_factory=dict)   # quota.Quotas.as_dict(): bytes each
    oldest_created: float | None = None   # epoch seconds of the oldest live block
    next_expiry: float | None = None      # epoch seconds of the next block to expire
    segments: int = 0
    snapshots: int = 0               # state-ledger snapshot files beside the store (`kvledger store stats`)
    snapshot_bytes: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BlockInfo(NamedTuple):
    """Metadata of one stored block, as `BlockStore.blocks` lists it (times in epoch seconds)."""

    key: bytes
    parent: bytes
    pos: int
    size: int
    created: float
    expiry: float | None   # None when the store does not know it
    namespace: str
    ttl_class: str


@dataclass(frozen=True, slots=True)
class ChainWrite:
    """Blocks of one chain written by one put call.

    `keys[i]` is the block at chain position `start_pos + i`; its parent is `keys[i-1]`
    (or `parent` for i = 0: the previous block's key, or the root key at position 0).
    """

    keys: Sequence[bytes]
    blocks: Sequence[Buffer]
    start_pos: int
    parent: bytes
    namespace: str
    ttl_class: str
    ttl_s: float

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.blocks):
            raise ValueError(f"one buffer per key: {len(self.keys)} keys, {len(self.blocks)} blocks")
        if isinstance(self.start_pos, bool) or not isinstance(self.start_pos, int) or self.start_pos < 0:
            raise ValueError(f"start_pos must be an integer >= 0, got {self.start_pos!r}")
        if not 0 < self.ttl_s < float("inf"):
            raise ValueError(f"ttl_s must be a positive finite number, got {self.ttl_s!r}")
        if len(self.parent) != KEY_BYTES or any(len(k) != KEY_BYTES for k in self.keys):
            raise ValueError(f"keys are {KEY_BYTES} bytes (kvledger.core.chain_keys)")


class BlockStore(Protocol):
    """What the ledger needs of a backend. Times are epoch seconds, sizes bytes.
    One suite checks every implementation: tests/store/test_contract.py."""

    counters: Counters

    def put(self, write: ChainWrite) -> PutResult: ...

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Leading blocks of `keys` present and unexpired, from metadata only; refreshes their expiry
        to at least now + `ttl_s`."""

    def match_explained(self, keys: Sequence[bytes], ttl_s: float) -> Match:
        """`match`, plus the tombstone of the first absent key, in the same call (no extra round trip;
        nothing more when every key is present). A fault: `Match(blocks before it, None)`, never raised."""

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Dest], *,
                 on_part: Callable[[int], None] | None = None) -> list[int]:
        """Read each block into its destination (a buffer, or a tuple of parts filled in order; at least the block's
        size in all); its size, or -1 for a miss. `on_part` (optional): a backend that reads block files reads part k
        of every block before part k + 1 and calls `on_part(k + 1)` after each (`SegmentFiles.read_by_part`), so a
        consumer may start on the first parts while later ones arrive; the sizes returned still decide which
        blocks arrived intact. One whose bytes arrive whole (inline in Redis) never calls it."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def blocks(self) -> Iterator[BlockInfo]:
        """Every live block's metadata (no block byte read), in no particular order."""

    def refresh(self, force: bool = False) -> None:
        """Learn now what other writers stored (a no-op where every reader shares one index)."""

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def forget(self, tenant: str, hold_s: float) -> Forgotten:
        """Hold `tenant` for `hold_s` seconds (its puts refused), then remove every block of its namespaces and every
        tombstone tagged with it, leaving no tombstone (store/forget.py). Faults are logged and counted as not
        removed, never raised."""

    def gc(self, batch: int = 4096) -> GcResult: ...

    def stats(self) -> StoreStats: ...

    def verify(self, remove: bool = True) -> VerifyResult: ...

    def probe(self) -> str | None:
        """None when this machine can read the store's folder now; else why not (a few metadata syscalls,
        never raises). A dead mount answers ENOTCONN here while the blocks on it may be fine elsewhere."""

    def close(self) -> None: ...
