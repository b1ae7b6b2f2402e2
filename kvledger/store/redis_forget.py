"""Forgetting a tenant in a RedisStore (store/forget.py): its holds, its blocks, their bytes on the mount, its
tombstones.

Order: (1) the holds, one key per hash slot a block can take (`Placement.hold_names`), each expiring with the
hold, so every PUT script reads the one of its own slot; (2) a SCAN of each master's blocks, and each block whose
metadata names one of the tenant's namespaces deleted together with its tombstone (a plain DEL, not BURY: a
forgotten block leaves no tombstone); (3) in the cluster mode, the segment files on the mount whose header names
one of the tenant's namespaces; (4) a SCAN of the tombstones, and those carrying the tenant's tag deleted. A PUT
that ran before (1) is found by (2) (SCAN returns every key that exists for its whole run); one after it is refused.
A master that fails is counted in `Forgotten.faults` and skipped: what it held may remain, and the receipt says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import redis

from kvledger.core import KEY_BYTES
from kvledger.store.forget import Forgotten, owned_by, tenant_tag
from kvledger.store.redis_meta import decode_meta
from kvledger.util.redis_fanout import FAULTS, Call, command

if TYPE_CHECKING:
    from kvledger.store.redis_backend import RedisStore

log = logging.getLogger("kvledger.store")
BATCH = 1000   # names read back per round trip


def forget(store: RedisStore, tenant: str, hold_s: float) -> Forgotten:
    """The module docstring's four steps for `tenant`; a fault is logged and counted, never raised."""
    got, tag = Forgotten(), tenant_tag(tenant)
    if hold_s > 0:
        holds = store.place.hold_names(tag)
        replies = store.nodes.run([Call(slot, command("SET", name, b"1", "PX", int(hold_s * 1000)))
                                   for slot, name in holds])
        faults = [r for r in replies if isinstance(r, BaseException)]
        got.faults += len(faults)
        if holds and not faults:
            got.held_until = time.time() + hold_s
        elif faults:
            log.warning("the hold of a forgotten tenant on %s failed: %s", store.shown, faults[0])
    for node, names in _scan(store, store.bprefix, got):
        _remove_blocks(store, node, names, tenant, got)
    if store.files is not None:
        got.files = store.files.forget(tenant)
    if store.place.tprefix:
        suffix = b"|" + tag.hex().encode()
        for node, names in _scan(store, store.place.tprefix, got):
            _remove_tombstones(node, names, suffix, got)
    return got


def _scan(store: RedisStore, prefix: bytes, got: Forgotten) -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """(master, names under `prefix` on it), BATCH at a time; a master that fails midway is counted and left."""
    for node in store.nodes.masters():
        cursor = 0
        try:
            while True:
                cursor, names = node.scan(cursor, match=prefix + b"*", count=BATCH)
                if names:
                    yield node, names
                if cursor == 0:
                    break
        except FAULTS as e:
            got.faults += 1
            log.warning("forget on %s: a master stopped answering (%s); what it holds of the tenant may remain",
                        store.shown, e)


def _remove_blocks(store: RedisStore, node: redis.Redis, names: list[bytes], tenant: str, got: Forgotten) -> None:
    """Delete, with their tombstones, the blocks among `names` (one master's) that are the tenant's."""
    pipe = node.pipeline(transaction=False)
    for name in names:
        pipe.hget(name, "m")
    mine = [(name, meta) for name, m in zip(names, pipe.execute())
            if m is not None and (meta := decode_meta(m)) is not None and owned_by(meta[6], tenant)]
    if not mine:
        return
    pipe = node.pipeline(transaction=False)
    for name, _ in mine:   # a block and its tombstone share a slot: one DEL
        tomb = store.place.tprefix + name[len(store.bprefix):] if store.place.tprefix else None
        pipe.delete(name, *([tomb] if tomb else []))
    for (name, meta), n in zip(mine, pipe.execute()):
        if n:
            got.blocks, got.bytes = got.blocks + 1, got.bytes + meta[2]
            got.keys.append(name[-KEY_BYTES:])


def _remove_tombstones(node: redis.Redis, names: list[bytes], suffix: bytes, got: Forgotten) -> None:
    """Delete the tombstones among `names` (one master's) whose value ends in the tenant's tag."""
    pipe = node.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    mine = [name for name, v in zip(names, pipe.execute()) if v is not None and v.endswith(suffix)]
    if not mine:
        return
    pipe = node.pipeline(transaction=False)
    for name in mine:
        pipe.delete(name)
    for name, n in zip(mine, pipe.execute()):
        got.tombstones += n
        got.keys.append(name[-KEY_BYTES:])
