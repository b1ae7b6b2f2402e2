"""Where the blocks of a RedisStore live: their key names and hash slots.

One Redis server: `{prefix}b:<16-byte key>`, as always. Redis Cluster:
`{prefix}b:{<tag>}<16-byte key>`, the tag one of TAGS = 64 group tags picked by the key's first byte
(`key[0] % 64`; chain keys are hashes, so the groups are even). Redis hashes only the tag, so a
group is one hash slot; the tags are chosen so the 64 slots sit one in each 256-slot window of
the 16,384 (`group_tags`), and every master serves about the same number of groups whatever
contiguous ranges `redis-cli --cluster create` (or a reshard) gave it.

Why 64 groups, not a tag per chain root nor a slot per key. A Redis script may touch keys of one
slot only, so CHECK runs one script per slot among the prompt's keys, batched per node (one round
trip per node touched). A tag per chain root (all of a prompt family in one slot) makes CHECK one
script on one node, but a hot system prompt, or a whole tenant, then loads one node and fills its
memory; nor can the store name a block by its root (get, exists and delete see only the key). A
slot per key spreads best but makes a CHECK of 8,192 keys ~8,000 scripts of one key, each
refreshing its block even past the first miss (a cold prompt: 8,000 commands where one server
stops at the first). 64 groups keep the load even (±1 group in 21 per master of three; a
cluster grows to ~64 masters before a node holds no group) and a CHECK of n keys runs
min(n, 64) scripts, each walking its group's keys in chain order and stopping at its own first
absent key. The price: a group can refresh a few present blocks past the chain's first absent
one (blocks after a hole, which a later put of the hole makes reachable again), and a slot
holds 1/64 of the blocks (a reshard moves whole groups). A `{` in `prefix` overrides the tag
(Redis hashes the first `{…}`): `prefix="kvl:{tenant}:"` puts every block in one slot, on purpose.

Tombstones: the tombstone of a block (redis_meta.py) is named as the block with `{prefix}t:` for
`{prefix}b:` — `{prefix}t:<key>`, `{prefix}t:{<tag>}<key>` — so it shares its block's hash slot and a
block's script reaches it. A prefix that leaves no common slot on a cluster (`{}`: Redis hashes whole
names; an unclosed `{`: the tag takes in `b:` or `t:`) keeps no tombstones (`Placement.tombs` False).

Quota accounting (redis_quota.py), per group, in the group's slot: `{prefix}u:{<tag>}` a hash of the group's
live bytes (field `t`) and each bucket's (`b` + bucket id; `n` + id its names), and `{prefix}z:{<tag>}<id>`
a sorted set per bucket of the group's blocks by last refresh. On one server the one group's names are
`{prefix}u:` and `{prefix}z:<id>`. Where tombstones cannot share a slot, neither can these: no accounting.

Holds (store/forget.py): a forgotten tenant's hold is one key per group, `{prefix}h:<tag hex>` on one server,
`{prefix}h:{<tag>}<tag hex>` on a cluster, so a block's PUT script reads the hold of its own slot. Where tombstones
cannot share a slot, neither can holds: such a store holds nothing (`Placement.holds` False).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from redis.crc import key_slot

from kvledger.core import KEY_BYTES

TAGS = 64
SLOTS = 16384


@functools.cache
def group_tags() -> tuple[bytes, ...]:
    """The tag of group g: the first `b"g.j"` (j = 0, 1, …) whose hash slot lies in window g of
    16384 / 64 = 256 slots. Part of the key layout: every client of a cluster computes the same."""
    width = SLOTS // TAGS
    tags = []
    for g in range(TAGS):
        j = 0
        while key_slot(b"%d.%d" % (g, j)) // width != g:
            j += 1
        tags.append(b"%d.%d" % (g, j))
    return tuple(tags)


def _tag_is_fixed(head: bytes) -> bool:
    """Whether Redis hashes a tag that ends inside `head` (so every `head + key` shares one slot)."""
    start = head.find(b"{")
    end = head.find(b"}", start + 1)
    return start >= 0 and end > start + 1


class Placement:
    """Names and slots of blocks under `bprefix` (`{prefix}b:`), and of their tombstones under `tprefix`
    (`{prefix}t:`; b"": none); `cluster` False: one server, one slot 0."""

    def __init__(self, bprefix: bytes, cluster: bool, tprefix: bytes = b"", uprefix: bytes = b"",
                 zprefix: bytes = b"") -> None:
        self.bprefix = bprefix
        self.cluster = cluster
        self.heads = [bprefix + b"{" + t + b"}" for t in group_tags()] if cluster else [bprefix] * TAGS
        fixed = cluster and all(_tag_is_fixed(h) for h in self.heads)
        self.slots: list[int] | None = [key_slot(h) for h in self.heads] if fixed else None
        # a tombstone must share its block's slot: with a prefix holding an unclosed `{` the tags would differ
        self.tombs = bool(tprefix) and self._same_slot(tprefix)
        self.tprefix = tprefix if self.tombs else b""
        self.accounted = bool(uprefix and zprefix) and self._same_slot(uprefix) and self._same_slot(zprefix)
        self.uprefix, self.zprefix = (uprefix, zprefix) if self.accounted else (b"", b"")
        hprefix = tprefix[:-2] + b"h:" if tprefix else b""   # `{prefix}h:`, beside `{prefix}t:`
        self.holds = bool(hprefix) and self._same_slot(hprefix)
        self.hprefix = hprefix if self.holds else b""

    def _same_slot(self, other: bytes) -> bool:
        """Whether names made with `other` for `bprefix` share each group's slot."""
        return not self.cluster or self.slots is not None and all(
            key_slot(other + h[len(self.bprefix):]) == slot for h, slot in zip(self.heads, self.slots))

    def group_tags(self) -> list[tuple[int, bytes]]:
        """(slot, tag part of the names: `{<tag>}`, or b"" on one server) of each group of blocks."""
        if not self.cluster:
            return [(0, b"")]
        assert self.slots is not None
        return [(slot, h[len(self.bprefix):]) for h, slot in zip(self.heads, self.slots)]

    def hold_name(self, key: bytes, tag: bytes) -> bytes | None:
        """The name of the hold of tenant `tag` in `key`'s slot (None where the store keeps none)."""
        if not self.holds:
            return None
        return self.hprefix + self.heads[(key[0] if key else 0) % TAGS][len(self.bprefix):] + tag.hex().encode()

    def hold_names(self, tag: bytes) -> list[tuple[int, bytes]]:
        """(slot, name) of the holds of tenant `tag`, one per group a block can take (none where none is kept)."""
        return [(slot, self.hprefix + part + tag.hex().encode()) for slot, part in self.group_tags()] if self.holds \
            else []

    def tomb_name(self, key: bytes) -> bytes | None:
        """The name of `key`'s tombstone (None where the store keeps none): `tprefix` for `bprefix` in its name."""
        return self.tprefix + self.name(key)[len(self.bprefix):] if self.tombs else None

    def name(self, key: bytes) -> bytes:
        return self.heads[(key[0] if key else 0) % TAGS] + key

    def names(self, keys: Sequence[bytes]) -> list[bytes]:
        heads = self.heads
        return [heads[(k[0] if k else 0) % TAGS] + k for k in keys]

    def key_of(self, name: bytes) -> bytes:
        """The block key a Redis key name holds (its last KEY_BYTES bytes in the cluster layout)."""
        return name[-KEY_BYTES:] if self.cluster else name[len(self.bprefix):]

    def slot(self, key: bytes) -> int:
        if not self.cluster:
            return 0
        if self.slots is not None:
            return self.slots[(key[0] if key else 0) % TAGS]
        return key_slot(self.name(key))

    def groups(self, keys: Sequence[bytes]) -> list[tuple[int, bytes, list[int]]]:
        """(slot, head, indexes into `keys` ascending) per group of keys sharing one slot and one name
        head (`head + key` is each one's name; head b"" when names differ): one group on one server, one
        per tag on a cluster."""
        if not self.cluster:
            return [(0, self.bprefix, list(range(len(keys))))]
        by: dict[int, list[int]] = {}
        if self.slots is not None:
            for i, k in enumerate(keys):
                by.setdefault((k[0] if k else 0) % TAGS, []).append(i)
            return [(self.slots[g], self.heads[g], idx) for g, idx in by.items()]
        for i, k in enumerate(keys):  # a prefix that makes Redis hash the whole name: slot by slot
            by.setdefault(key_slot(self.name(k)), []).append(i)
        return [(slot, b"", idx) for slot, idx in by.items()]

    def names_of(self, keys: Sequence[bytes], head: bytes, idx: Sequence[int]) -> list[bytes]:
        """What to send for `keys[idx]` in a group with this head: bare keys, or whole names (head b"")."""
        return [keys[i] for i in idx] if head else [self.name(keys[i]) for i in idx]
