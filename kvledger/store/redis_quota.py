"""Capacity and quotas of a `RedisStore` (quota.py): the totals Redis keeps per bucket, eviction down to the
capacity, and the sweep of blocks Redis expired by itself. The scripts are redis_meta.py's; the names redis_keys.py's.

What Redis holds, per group of blocks (one hash slot; one group on one server):

    {prefix}u:{tag}          hash: `t` live bytes of the group; `b<id>` of each bucket; `n<id>` the bucket's names
    {prefix}z:{tag}<id>      sorted set: the bucket's blocks in the group (key + size), scored by last refresh (ms)

Every script that adds a block (PUT), refreshes it (MATCH) or removes it (BURY, EVICT) changes these in the same
script, so a total is one read per group (one round trip per master) and eviction walks only its victims.
Redis's own expiry has no hook: a block it expired stays counted until eviction or the sweep meets its member
(both release members whose block is gone), so the totals can over-count, by blocks expired since, never under.

Eviction, after a put that leaves the store past `capacity_bytes`: down to LOW_WATERMARK × capacity, victims by
`quota.pick` over every bucket's sets (their first pages in one round trip per master, later pages as needed),
removed by one EVICT script per group. What the guarantees leave to free (over-subscribed) goes by recency
alone and is counted in `quota_overrides`. Writers evicting at once each release a victim at most once (the
script checks the member is still there at the planned score: not hit since, not taken by another), so they can
over-evict by one plan, never count twice.

Grain: a hit moves a block in its set when it refreshes the block's expiry (redis_meta.py: TTL / 64, ~68 min for
agent's 3 days), so blocks hit within one grain are ordered by their earlier refresh.
"""

from __future__ import annotations

import heapq
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvledger.store import quota
from kvledger.store.backend import Counters
from kvledger.store.quota import Bucket, Candidate, Quotas
from kvledger.store.redis_keys import Placement
from kvledger.util.redis_fanout import FAULTS, Call, RedisNodes, command, script_call

log = logging.getLogger("kvledger.store")

LOW_WATERMARK = 0.9    # eviction frees down to this share of the capacity (as the embedded store)
PAGE = 128             # members of one set read per round trip
EVICT_CHUNK = 256      # blocks per EVICT script
MAX_ROUNDS = 16        # plans per eviction (each frees what it planned unless other writers moved it)
SIZE = struct.Struct("<I")
Usage = dict[bytes, dict[bytes, tuple[Bucket, int]]]   # group tag → bucket id → (bucket, live bytes in it)


def _pairs(reply: dict | list) -> list[tuple]:
    """A reply of pairs (HGETALL, ZRANGE WITHSCORES) as (a, b) tuples, in RESP3 (a map; a list of pairs) or RESP2
    (one flat list)."""
    if isinstance(reply, dict):
        return list(reply.items())
    if reply and isinstance(reply[0], list):
        return [tuple(p) for p in reply]
    return list(zip(reply[0::2], reply[1::2]))


def quota_field(bucket_id: bytes, size: int) -> bytes:
    """A block's field `q`: its bucket id and its size (what its member and its release need)."""
    return bucket_id + SIZE.pack(size)


@dataclass(slots=True)
class RedisQuota:
    """The totals and eviction of one store (see the module docstring). `scripts`: the EVICT sha; `bury_args`:
    (tombstone prefix, block prefix length, grace ms, usage prefix, set prefix), the scripts' common ARGV;
    `where` names the store in logs. Sizes bytes."""

    nodes: RedisNodes
    place: Placement
    capacity_bytes: int | None
    quotas: Quotas
    counters: Counters
    evict_sha: str
    bury_args: tuple
    where: str

    # --- totals ----------------------------------------------------------------------------------------

    def total(self) -> int:
        """Live bytes over every group (raises a Redis fault)."""
        calls = [Call(slot, command("HGET", self.place.uprefix + tag, "t")) for slot, tag in self.place.group_tags()]
        replies = self.nodes.run(calls)
        for r in replies:
            if isinstance(r, BaseException):
                raise r
        return sum(int(r) for r in replies if r is not None)

    def usage(self) -> Usage:
        """Each group's buckets and their live bytes (raises a Redis fault)."""
        groups = self.place.group_tags()
        replies = self.nodes.run([Call(slot, command("HGETALL", self.place.uprefix + tag)) for slot, tag in groups])
        out: Usage = {}
        for (_, tag), reply in zip(groups, replies):
            if isinstance(reply, BaseException):
                raise reply
            fields = dict(_pairs(reply))
            out[tag] = {f[1:]: (Bucket.unpack(fields[b"n" + f[1:]]), int(v)) for f, v in fields.items()
                        if f[:1] == b"b" and b"n" + f[1:] in fields}
        return out

    @staticmethod
    def overall(usage: Usage) -> dict[bytes, tuple[Bucket, int]]:
        """Bucket id → (bucket, live bytes over every group)."""
        out: dict[bytes, tuple[Bucket, int]] = {}
        for buckets in usage.values():
            for bid, (bucket, nbytes) in buckets.items():
                out[bid] = (bucket, out.get(bid, (bucket, 0))[1] + nbytes)
        return out

    # --- eviction --------------------------------------------------------------------------------------

    def make_room(self) -> None:
        """After a put: past the capacity, evict down to LOW_WATERMARK of it (the module docstring). Faults are
        logged, never raised (the put is done; the next one tries again)."""
        cap = self.capacity_bytes
        if cap is None:
            return
        try:
            total = self.total()
            if total <= cap:
                return
            need = total - int(cap * LOW_WATERMARK)
            n, freed = self._evict(self.quotas, need)
            if freed < need and self.quotas:
                more, more_freed = self._evict(Quotas(), need - freed)
                if more:
                    log.warning("%s: every namespace is within its guarantee and the store is still over capacity "
                                "(guarantees over-subscribed): %d blocks (%d bytes) evicted by recency alone",
                                self.where, more, more_freed)
                    self.counters.quota_overrides += more
                n += more
            self.counters.gc_evicted += n
        except FAULTS as e:
            log.warning("eviction on %s stopped: %s", self.where, e)

    def _evict(self, quotas: Quotas, need: int) -> tuple[int, int]:
        """Plans of `quota.pick` under `quotas`, carried out, until `need` bytes are released; (blocks deleted,
        bytes released)."""
        deleted = released = 0
        for _ in range(MAX_ROUNDS):
            if released >= need:
                break
            usage = self.usage()
            streams = self._streams(usage)
            picked = quota.pick(quotas, self.overall(usage), streams, need - released)
            if not picked.victims:
                break
            n, freed = self._release([c.handle for _, c in picked.victims], "evict")
            deleted, released = deleted + n, released + freed
            if freed == 0:
                break   # every victim was hit or taken since the plan
        return deleted, released

    def _streams(self, usage: Usage) -> dict[bytes, Iterator[Candidate]]:
        """Per bucket id, its candidates over every group, least recently refreshed first: the first page of each
        set in one round trip per master, the next ones as `pick` reaches them."""
        sets = [(slot, tag, bid) for slot, tag in self.place.group_tags() for bid in usage.get(tag, {})]
        firsts = self.nodes.run([Call(slot, self._zrange(tag, bid, 0)) for slot, tag, bid in sets])
        per_bucket: dict[bytes, list[Iterator[Candidate]]] = {}
        for (slot, tag, bid), first in zip(sets, firsts):
            if isinstance(first, BaseException):
                raise first
            per_bucket.setdefault(bid, []).append(self._pages(slot, tag, bid, first))
        return {bid: heapq.merge(*its) for bid, its in per_bucket.items()}

    def _zrange(self, tag: bytes, bid: bytes, start: int) -> list:
        return command("ZRANGE", self.place.zprefix + tag + bid, start, start + PAGE - 1, "WITHSCORES")

    def _pages(self, slot: int, tag: bytes, bid: bytes, page: list, more: bool = True) -> Iterator[Candidate]:
        """One set's members as candidates, page by page (order: (score, member), as the set sorts them);
        `more=False`: this page only."""
        start = 0
        while page:
            pairs = _pairs(page)
            for member, score in pairs:
                size = SIZE.unpack_from(member, 16)[0]
                name = self.place.name(member[:16])
                yield Candidate((float(score), member), size, (slot, name, quota_field(bid, size), score))
            if not more or len(pairs) < PAGE:
                return
            start += PAGE
            page = self.nodes.run([Call(slot, self._zrange(tag, bid, start))])[0]
            if isinstance(page, BaseException):
                raise page

    def _release(self, handles: Sequence[tuple], mode: str) -> tuple[int, int]:
        """EVICT (mode 'evict' or 'sweep') over the blocks `handles` name, one script per slot and chunk;
        (blocks deleted, bytes released)."""
        by_slot: dict[int, list[tuple]] = {}
        for h in handles:
            by_slot.setdefault(h[0], []).append(h)
        calls = []
        for slot, hs in by_slot.items():
            for i in range(0, len(hs), EVICT_CHUNK):
                chunk = hs[i:i + EVICT_CHUNK]
                argv = [a for _, _, q, score in chunk for a in (q, score)]
                calls.append(Call(slot, script_call(self.evict_sha, [name for _, name, _, _ in chunk],
                                                    *self.bury_args, mode, *argv)))
        deleted = released = 0
        for reply in self.nodes.run(calls):
            if isinstance(reply, BaseException):
                raise reply
            deleted, released = deleted + int(reply[0]), released + int(reply[1])
        return deleted, released

    # --- upkeep ----------------------------------------------------------------------------------------

    def sweep(self, rounds: int = 8) -> tuple[int, int]:
        """Release the members of blocks Redis no longer holds, from the least recently refreshed page of each set
        (again while the last round released any, up to `rounds` times); (bytes released, rounds). Raises a
        fault."""
        released = done = 0
        for done in range(1, rounds + 1):  # noqa: B007 - the count is returned
            usage = self.usage()
            sets = [(slot, tag, bid) for slot, tag in self.place.group_tags() for bid in usage.get(tag, {})]
            pages = self.nodes.run([Call(slot, self._zrange(tag, bid, 0)) for slot, tag, bid in sets])
            handles = []
            for (slot, tag, bid), page in zip(sets, pages):
                if isinstance(page, BaseException):
                    raise page
                handles += [c.handle for c in self._pages(slot, tag, bid, page, more=False)]
            if not handles:
                break
            _, freed = self._release(handles, "sweep")
            released += freed
            if freed == 0:
                break
        return released, done
