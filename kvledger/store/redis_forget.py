"""Forgetting a tenant in a RedisStore (store/forget.py): its holds, its blocks, their bytes on the mount, its
tombstones.

Order: (1) the holds, one key per hash slot a block can take (`Placement.hold_names`), each expiring with the
hold, so every PUT script reads the one of its own slot; (2) a SCAN of each master's blocks, and each block whose
metadata names one of the tenant's namespaces deleted with its tombstone, its bytes released from its quota
bucket (redis_meta.FORGET, one script per slot: no BURY, so a forgotten block leaves no tombstone); (3) the
tenant's quota buckets in every group, with what they still count of blocks Redis expired by itself
(redis_meta.FORGET_BUCKETS: the bucket's names leave the usage hash); (4) in the cluster mode, the segment files on
the mount whose header names one of the tenant's namespaces; (5) a SCAN of the tombstones, and those carrying the
tenant's tag deleted. A PUT that ran before (1) is found by (2) (SCAN returns every key that exists for its whole
run); one after it is refused. A master that fails is counted in `Forgotten.faults` and skipped: what it held may
remain, and the receipt says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import redis

from kvledger.core import KEY_BYTES
from kvledger.store.backend import shown_name
from kvledger.store.forget import Forgotten, owned_by, tenant_tag
from kvledger.store.quota import Bucket
from kvledger.store.redis_meta import FORGET, FORGET_BUCKETS, decode_meta
from kvledger.util.redis_fanout import FAULTS, Call, command, script_call

if TYPE_CHECKING:
    from kvledger.store.redis_backend import RedisStore

log = logging.getLogger("kvledger.store")
BATCH = 1000   # names read back per round trip


def forget(store: RedisStore, tenant: str, hold_s: float, script_args: tuple) -> Forgotten:
    """The module docstring's five steps for `tenant`; `script_args`: BURY's common ARGV (the tombstone prefix, the
    block prefix's length, the grace ms, the quota names' prefixes). A fault is logged and counted, never raised."""
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
        _remove_blocks(store, node, names, tenant, script_args, got)
    _forget_buckets(store, tenant, got)
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


def _remove_blocks(store: RedisStore, node: redis.Redis, names: list[bytes], tenant: str, script_args: tuple,
                   got: Forgotten) -> None:
    """Delete, with their tombstones and their quota accounting, the blocks among `names` (one master's) that are
    the tenant's: one FORGET script per hash slot."""
    pipe = node.pipeline(transaction=False)
    for name in names:
        pipe.hget(name, "m")
    mine = [(name, meta) for name, m in zip(names, pipe.execute())
            if m is not None and (meta := decode_meta(m)) is not None and owned_by(meta[6], tenant)]
    by_slot: dict[int, list[tuple[bytes, tuple]]] = {}
    for name, meta in mine:
        by_slot.setdefault(store.nodes.slot(name), []).append((name, meta))
    sha = store.nodes.script(FORGET)
    slots = list(by_slot)
    replies = store.nodes.run([Call(slot, script_call(sha, [n for n, _ in by_slot[slot]], *script_args))
                               for slot in slots])
    for slot, reply in zip(slots, replies):
        if isinstance(reply, BaseException):
            got.faults += 1
            log.warning("forget on %s: deleting blocks failed (%s); they may remain", store.shown, reply)
            continue
        got.blocks += int(reply)
        for name, meta in by_slot[slot]:
            got.bytes += meta[2]
            got.keys.append(name[-KEY_BYTES:])


def _forget_buckets(store: RedisStore, tenant: str, got: Forgotten) -> None:
    """Step (3): in each group's usage hash, the tenant's bucket ids (`n<id>` names it), then FORGET_BUCKETS there."""
    if not store.place.accounted:
        return
    groups = store.place.group_tags()
    replies = store.nodes.run([Call(slot, command("HGETALL", store.place.uprefix + tag)) for slot, tag in groups])
    calls = []
    for (slot, tag), reply in zip(groups, replies):
        if isinstance(reply, BaseException):
            got.faults += 1
            continue
        ids = [field[1:] for field, value in _field_pairs(reply)
               if field[:1] == b"n" and shown_name(Bucket.unpack(value).namespace) == tenant]
        if ids:
            calls.append(Call(slot, script_call(store.nodes.script(FORGET_BUCKETS), [store.place.uprefix + tag],
                                                store.place.zprefix + tag, *ids)))
    for reply in store.nodes.run(calls):
        if isinstance(reply, BaseException):
            got.faults += 1


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


def _field_pairs(reply: dict | list) -> list[tuple[bytes, bytes]]:
    """HGETALL's reply as (field, value) pairs, whether the client parsed it to a map or left it a flat list."""
    return list(reply.items()) if isinstance(reply, dict) else list(zip(reply[0::2], reply[1::2]))
