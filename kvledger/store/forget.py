"""Forgetting a tenant in the block ledger (DESIGN rule 12): every block, tombstone and snapshot file of its
namespaces goes, and a hold refuses its late writes for a while.

    got = forget_store(store, "acme", hold_s=600, root=Path("/var/lib/kvledger/blocks"))
    got.receipt() → {"blocks": 42, "bytes": 4_784_128, "files": 3, "tombstones": 7, "snapshot_files": 2, ...}

A tenant's namespaces are its own and each of its salted ones (`core.salted_namespace`: "acme#salt-…"): those
`core.tenant_of` maps to it. Where a store records a block's namespace (the LMDB index per segment, the Redis record
per block, a shared segment file's header), forgetting reads it there.

Tombstones (why a block is gone, kept after its bytes) carry the `tenant_tag` of the block they stand for, 8 bytes:
a forget finds the tombstones of blocks that went before it, not only of those it removes. A block forgotten leaves
no tombstone: its tenant's next request is cold, never "evicted". (Tombstones written before tags existed carry
none and stay until their bound drops them.)

The hold. Writers a forget cannot reach (an engine cut off from the entrypoint, a vLLM process on the same store, a
put already in flight) could bring a block back after it. So a forget first records, in the store itself, a hold on
the tenant for `hold_s` seconds (an LMDB row beside the totals; on Redis a key in each hash slot a block can take,
expiring on its own), and every put of a held tenant's namespace is refused inside the same transaction or script
that would index it (`Counters.blocks_refused`). A put indexed before the hold is seen by the removal that follows
it; one after it is refused. `hold_s` 0: no hold. Units: seconds, bytes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvledger.core import tenant_of
from kvledger.core.keys import SALT_MARK, namespace_bytes
from kvledger.store.backend import MAX_NAME_BYTES

if TYPE_CHECKING:
    from kvledger.store.backend import BlockStore

TAG_BYTES = 8
DEFAULT_HOLD_S = 600.0        # longer than a request runs: the late writes of an engine a forget did not reach
MAX_HOLD_S = 30 * 86_400.0
SALTED_EXTRA = len(SALT_MARK) + 32   # what `salted_namespace` adds to a tenant's name (its hex digest)
MAX_TENANT_BYTES = MAX_NAME_BYTES - SALTED_EXTRA   # so every salted namespace of it is stored whole, never digested


def tenant_tag(namespace: str) -> bytes:
    """The 8-byte tag of the tenant of `namespace` (salts dropped: `core.tenant_of`), as tombstones and holds carry
    it. A SHA-256 prefix: tags of distinct tenants differ but by chance (2**-64 a pair)."""
    return hashlib.sha256(b"kvledger/tenant\x00" + namespace_bytes(tenant_of(namespace))).digest()[:TAG_BYTES]


def owned_by(namespace: str, tenant: str) -> bool:
    """Whether `namespace` is one of `tenant`'s: the tenant's own, or one of its salted ones."""
    return tenant_of(namespace) == tenant


def check_tenant(name: object) -> str:
    """`name` when it can be forgotten: a non-empty str of at most MAX_TENANT_BYTES bytes that is a tenant's own
    namespace (no salt mark: a tenant's salted namespaces go with it). ValueError saying why not."""
    if not isinstance(name, str) or not name:
        raise ValueError("give the tenant's namespace (its name in --api-keys; \"default\" on an open server)")
    if SALT_MARK in name:
        raise ValueError(f"{name[:64]!r} is a salted namespace: forget its tenant ({tenant_of(name)[:64]!r}), whose "
                         "salted namespaces go with it")
    if len(namespace_bytes(name)) > MAX_TENANT_BYTES:
        raise ValueError(f"a tenant's namespace has at most {MAX_TENANT_BYTES} bytes")
    return name


def check_hold(hold_s: object) -> float:
    """`hold_s` as seconds in [0, MAX_HOLD_S]; ValueError otherwise."""
    if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not 0 <= hold_s <= MAX_HOLD_S:
        raise ValueError(f"the hold is a number of seconds in [0, {MAX_HOLD_S:.0f}]")
    return float(hold_s)


@dataclass(slots=True)
class Forgotten:
    """What a forget removed from a block store: blocks (their bytes), segment files unlinked, tombstones, snapshot
    files (the tenant's, by its blocks' and tombstones' keys; and orphans: files whose block no index holds, anyone's
    and unusable, as `kvledger store gc` removes them), until when (epoch s) its writes are held, and the faults that
    left something where it was. `keys`: the
    chain keys forgotten (blocks and tombstones), for the parts that keep things by key (snapshots)."""

    blocks: int = 0
    bytes: int = 0
    files: int = 0
    tombstones: int = 0
    snapshot_files: int = 0
    orphan_snapshot_files: int = 0
    held_until: float | None = None
    faults: int = 0          # parts that did not answer (a Redis master, the index): what they hold may remain
    keys: list[bytes] = field(default_factory=list, repr=False)

    def receipt(self) -> dict[str, Any]:
        """The counts, as a receipt shows them (no key)."""
        out = asdict(self)
        del out["keys"]
        return out


def forget_store(store: BlockStore, tenant: str, *, hold_s: float = DEFAULT_HOLD_S,
                 root: str | os.PathLike | None = None) -> Forgotten:
    """Forget `tenant` in `store` (hold first, then blocks and tombstones: `BlockStore.forget`), then the snapshot
    files under `root` (the store's folder, where the state ledger keeps them beside the blocks) of the keys it
    forgot, and the orphans. Raises nothing for a fault of the store (rule 8: counted as not removed)."""
    from kvledger.store.snapshots import collect_snapshots, remove_snapshots

    got = store.forget(check_tenant(tenant), check_hold(hold_s))
    if root is not None:
        got.snapshot_files = remove_snapshots(root, got.keys)
        got.orphan_snapshot_files = collect_snapshots(root, store).removed
    return got
