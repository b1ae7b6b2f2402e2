"""Guaranteed shares of a block store (DESIGN.md rule 12): who owns a block's bytes, and which blocks eviction
may take. Pure logic: the stores (lmdb_gc.py, redis_quota.py) feed it their totals and their recency orders.

    bucket     (tenant namespace, TTL class) of a block: a store keeps each bucket's live bytes in its index, in the
               transaction (LMDB) or script (Redis) that adds or removes the block, and orders each bucket's blocks
               by last hit. The tenant namespace is `core.tenant_of` the block's namespace: a salted namespace
               counts as its tenant's, so no choice of cache salts splits a tenant's share.
    owner      who a bucket's bytes count against: its namespace when `Quotas.namespaces` names it, else its class
               when `Quotas.classes` names it, else nobody (the shared rest, guarantee 0).
    room       what an owner may lose: its live bytes minus its guarantee (the shared rest: unbounded).
    eviction   `pick`: least recently hit first among the buckets whose owner has room; an owner whose next
               victim is larger than its room is done (never taken below its guarantee) while others remain.
               When none remains and the store is still over capacity (guarantees over-subscribed), the store
               falls back to plain recency and counts what that takes (`Counters.quota_overrides`).

Worked example (the review's case, in blocks of 4 KiB): capacity 40, `alpha` guaranteed 10, alpha holds 8
(its hot prefix), `beta` floods. beta's owner is the shared rest (room unbounded), alpha's room is 8 − 10 < 0:
every eviction takes beta's least recently hit blocks and alpha keeps its 8.

Sizes are bytes; a guarantee is > 0 (a namespace without one is simply not named).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvledger.core.keys import SALT_MARK
from kvledger.store.backend import shown_name
from kvledger.util.units import parse_size

NAMESPACE, CLASS = "namespace", "class"   # the kinds of owner
BUCKET_ID_BYTES = 8
_NAMES = struct.Struct("<H")            # a bucket's packed names: ns length, then ns and class bytes
_SALT = SALT_MARK.encode()              # `core.tenant_of` on stored bytes


class Owner(NamedTuple):
    """Who a guarantee belongs to: (NAMESPACE, tenant namespace) or (CLASS, TTL class)."""

    kind: str
    name: str


class Bucket(NamedTuple):
    """A tenant namespace and a TTL class, as a store records them (stored names: `backend.stored_name`)."""

    namespace: bytes
    ttl_class: bytes

    @property
    def id(self) -> bytes:
        return bucket_id(self.namespace, self.ttl_class)

    def pack(self) -> bytes:
        return _NAMES.pack(len(self.namespace)) + self.namespace + self.ttl_class

    @classmethod
    def unpack(cls, raw: bytes) -> Bucket:
        (n,) = _NAMES.unpack_from(raw)
        return cls(bytes(raw[2:2 + n]), bytes(raw[2 + n:]))


def bucket_of(namespace: bytes, ttl_class: bytes) -> Bucket:
    """The bucket of a block whose stored namespace and class are these (its tenant's namespace: salts dropped)."""
    mark = namespace.find(_SALT)
    return Bucket(namespace if mark < 0 else namespace[:mark], ttl_class)


@functools.lru_cache(maxsize=4096)
def bucket_and_id(namespace: bytes, ttl_class: bytes) -> tuple[bytes, Bucket]:
    """(bucket id, bucket) of a block's stored namespace and class (cached: one hash per pair, not per put)."""
    bucket = bucket_of(namespace, ttl_class)
    return bucket.id, bucket


def bucket_id(namespace: bytes, ttl_class: bytes) -> bytes:
    """8 bytes naming a bucket in an index (length-prefixed: no two (namespace, class) pairs spell one id)."""
    h = hashlib.blake2b(struct.pack("<II", len(namespace), len(ttl_class)) + namespace + ttl_class,
                        digest_size=BUCKET_ID_BYTES)
    return h.digest()


def bytes_by_name(usage: Iterable[tuple[Bucket, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """Live bytes per tenant namespace and per TTL class, from the buckets' totals (no scan of blocks)."""
    by_ns: dict[str, int] = {}
    by_cls: dict[str, int] = {}
    for bucket, nbytes in usage:
        ns, cl = shown_name(bucket.namespace), shown_name(bucket.ttl_class)
        by_ns[ns] = by_ns.get(ns, 0) + nbytes
        by_cls[cl] = by_cls.get(cl, 0) + nbytes
    return by_ns, by_cls


@dataclass(frozen=True, slots=True)
class Quotas:
    """Guaranteed bytes per tenant namespace and per TTL class. Invariant: every guarantee is > 0. Empty: no
    guarantee, eviction is plain recency (what a store did before quotas)."""

    namespaces: Mapping[str, int] = field(default_factory=dict)
    classes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, g in (*self.namespaces.items(), *self.classes.items()):
            assert isinstance(g, int) and g > 0, f"guarantee of {name!r} must be > 0 bytes, got {g!r}"

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.classes)

    @property
    def total(self) -> int:
        return sum(self.namespaces.values()) + sum(self.classes.values())

    def owner(self, bucket: Bucket) -> Owner | None:
        """Whose guarantee a bucket's bytes count against (None: the shared rest)."""
        ns = shown_name(bucket.namespace)
        if ns in self.namespaces:
            return Owner(NAMESPACE, ns)
        cls = shown_name(bucket.ttl_class)
        if cls in self.classes:
            return Owner(CLASS, cls)
        return None

    def guarantee(self, owner: Owner) -> int:
        table = self.namespaces if owner.kind == NAMESPACE else self.classes
        return table.get(owner.name, 0)

    def describe(self, capacity: int | None) -> str:
        """One line for a server's start: each guarantee, and their share of `capacity` (over-subscribed said)."""
        parts = [f"{n} {g:,} B" for n, g in sorted(self.namespaces.items())]
        parts += [f"class {c} {g:,} B" for c, g in sorted(self.classes.items())]
        line = "guaranteed: " + ", ".join(parts)
        if capacity is None:
            return line + " (no --store-capacity: nothing is evicted)"
        if self.total > capacity:
            return line + (f" — {self.total:,} B over-subscribe the capacity {capacity:,} B: past it, eviction "
                           "falls back to recency (counted in quota_overrides)")
        return line + f" ({self.total:,} of {capacity:,} B; the rest shared by recency)"

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"namespaces": dict(self.namespaces), "classes": dict(self.classes)}

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Quotas:
        """The inverse of `to_json`; an empty `Quotas` for anything that is not one (a store's record is advice)."""
        try:
            data = json.loads(raw)
            return cls({str(k): int(v) for k, v in data.get("namespaces", {}).items()},
                       {str(k): int(v) for k, v in data.get("classes", {}).items()})
        except (ValueError, TypeError, AttributeError, AssertionError):
            return cls()


def parse_quota(text: str, classes: Iterable[str]) -> tuple[Owner, int]:
    """`--quota NAME=SIZE` → (owner, bytes). NAME is a TTL class when it is one of `classes`, else a namespace;
    `namespace:NAME` and `class:NAME` say which. SIZE as `util.units.parse_size` reads it (512MB, 2GiB, bytes).
    ValueError quoting the text."""
    name, eq, size_text = text.rpartition("=")
    if not eq or not name.strip():
        raise ValueError(f"expected NAMESPACE_OR_CLASS=SIZE such as alpha=512MB, got {text!r}")
    name = name.strip()
    kinds = {f"{NAMESPACE}:": NAMESPACE, f"{CLASS}:": CLASS}
    kind = next((k for prefix, k in kinds.items() if name.startswith(prefix)), None)
    if kind is not None:
        name = name.split(":", 1)[1]
    else:
        kind = CLASS if name in set(classes) else NAMESPACE
    if kind == CLASS and name not in set(classes):
        raise ValueError(f"unknown TTL class {name!r} in {text!r}; known: {', '.join(sorted(classes))}")
    size = parse_size(size_text)
    if not 1 <= size < math.inf:
        raise ValueError(f"a guarantee is a finite size of at least one byte, got {text!r}")
    return Owner(kind, name), int(size)


def default_share(capacity: int, tenants: int) -> int:
    """The guarantee of each tenant of a key file that states none: capacity / (2 × tenants), so the guarantees
    together take half the store and the other half is shared by recency."""
    assert capacity > 0 and tenants > 0
    return max(1, capacity // (2 * tenants))


def resolve_quotas(capacity: int | None, flags: Iterable[tuple[Owner, int]],
                   tenants: Mapping[str, int | None] | None) -> Quotas:
    """The one decision of who is guaranteed what (`kvledger serve|up|entrypoint|engine`).

    `flags`: the `--quota` settings (parsed); `tenants`: each key file namespace → its key's own `quota` (None:
    not stated); None without a key file. Precedence: a `--quota` of a namespace, then its keys' quota (the
    largest, when keys share a namespace), then with a capacity `default_share` over the key file's
    namespaces. Without a capacity nothing is evicted, so only what is stated is kept (for `store stats`)."""
    namespaces: dict[str, int] = {}
    classes: dict[str, int] = {}
    if tenants:
        default = default_share(capacity, len(tenants)) if capacity is not None else None
        for ns, stated in tenants.items():
            g = stated if stated is not None else default
            if g is not None:
                namespaces[ns] = g
    for owner, g in flags:
        (namespaces if owner.kind == NAMESPACE else classes)[owner.name] = g
    return Quotas(namespaces, classes)


# --- eviction -------------------------------------------------------------------------------------------


class Candidate(NamedTuple):
    """A block or segment eviction may take: `order` sorts least recently hit first (a store's own order key),
    `size` its live bytes, `handle` what the store needs to remove it (a segment id, a block name)."""

    order: Any
    size: int
    handle: Any


@dataclass(slots=True)
class Picked:
    """What `pick` chose, least recently hit first; `freed` their bytes (≤ what was asked only when the
    buckets with room ran out: the store then falls back to plain recency)."""

    victims: list[tuple[bytes, Candidate]] = field(default_factory=list)   # (bucket id, candidate)
    freed: int = 0


def rooms(quotas: Quotas, usage: Mapping[bytes, tuple[Bucket, int]]) -> dict[Owner, int]:
    """Each guaranteed owner's room: its live bytes (over its buckets in `usage`: id → (bucket, bytes)) minus its
    guarantee; owners without a byte stored have negative room (their whole guarantee unused)."""
    out = {Owner(NAMESPACE, n): -g for n, g in quotas.namespaces.items()}
    out |= {Owner(CLASS, c): -g for c, g in quotas.classes.items()}
    for bucket, nbytes in usage.values():
        owner = quotas.owner(bucket)
        if owner is not None:
            out[owner] += nbytes
    return out


def pick(quotas: Quotas, usage: Mapping[bytes, tuple[Bucket, int]], streams: Mapping[bytes, Iterator[Candidate]],
         need: int) -> Picked:
    """Victims for `need` bytes: least recently hit first over the buckets' `streams` (bucket id → its candidates,
    least recently hit first), taking from a guaranteed owner only while the victim fits in its room (`rooms`).

    Cost: O(B log B) to start (B = buckets with room) and O(log B) per victim; an owner that runs out of room
    drops its streams at once, so its remaining blocks are never walked. Invariant: no owner's live bytes fall
    below its guarantee through these victims."""
    room = rooms(quotas, usage)
    owner_of = {bid: quotas.owner(bucket) for bid, (bucket, _) in usage.items()}
    heap: list[tuple[Any, int, bytes, Candidate]] = []
    seq = 0

    def push(bid: bytes) -> None:
        nonlocal seq
        cand = next(streams[bid], None)
        if cand is not None:
            heapq.heappush(heap, (cand.order, seq, bid, cand))
            seq += 1

    for bid in streams:
        owner = owner_of.get(bid)
        if owner is None or room[owner] > 0:
            push(bid)
    out = Picked()
    taken: set[Owner] = set()
    while heap and out.freed < need:
        _, _, bid, cand = heapq.heappop(heap)
        owner = owner_of.get(bid)
        if owner is not None:
            if room[owner] < cand.size:
                room[owner] = 0   # done: every other stream of this owner is dropped as it comes up
                continue
            room[owner] -= cand.size
            taken.add(owner)
        out.victims.append((bid, cand))
        out.freed += cand.size
        push(bid)
    assert all(room[o] >= 0 for o in taken), "an owner was taken below its guarantee"
    return out
