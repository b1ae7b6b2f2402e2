"""The device block pool: reference-counted blocks, a prefix cache by chain key, an LRU free queue.

Every block is in exactly one of three states:

    | state  | ref_count | key      | where                         |
    |--------|-----------|----------|-------------------------------|
    | used   | > 0       | any      | some sequence's block table   |
    | cached | 0         | set      | free queue (reusable by key)  |
    | free   | 0         | None     | free queue                    |

free + cached + used = total (block 0, the null block, is never handed out and counts in none).
The free queue is in eviction order: the least recently released block is taken first, and
taking a cached block drops its key. Keys are `core.chain_keys` values, never a second hash.

A keyed block also names its tenant (`core.tenant_of` of the namespace it was computed in), so that forgetting
a tenant (DESIGN rule 12) drops its keys, used blocks' included, and its next request is cold (`forget`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvledger.engine.models.base import NULL_BLOCK


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    tenant: str = ""          # whose block `key` is (set with it; "" when not given)


class NoFreeBlocks(Exception):
    """The pool cannot hand out the blocks asked for (the scheduler waits or preempts)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, "the pool needs the null block and at least one more"
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.by_key: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))

    @property
    def total(self) -> int:
        return len(self.blocks) - 1

    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (free or cached)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref_count 1 and no key, least recently released first."""
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0, f"block {block_id} in the free queue while in use"
            if block.key is not None:
                del self.by_key[block.key]
                block.key, block.tenant = None, ""
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The leading blocks of `keys` held on the device; each is referenced once more."""
        out = []
        for key in keys:
            block_id = self.by_key.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            assert block.key == key, "the wrong block was assigned from the prefix cache"
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            out.append(block_id)
        return out

    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` the device holds (no reference taken)."""
        n = 0
        for key in keys:
            if key not in self.by_key:
                break
            n += 1
        return n

    def cache(self, block_id: int, key: bytes, tenant: str = "") -> None:
        """Record that `block_id` (in use, full) holds the block of chain key `key`, computed for `tenant`."""
        block = self.blocks[block_id]
        assert block.ref_count > 0 and block_id != NULL_BLOCK, "only a used block can be cached"
        if block.key == key:
            return
        if key in self.by_key:  # another block already holds this key: keep the first one
            return
        assert block.key is None, f"block {block_id} already caches another key"
        block.key, block.tenant = key, tenant
        self.by_key[key] = block_id

    def forget(self, tenant: str) -> int:
        """Drop the key of every block of `tenant`, cached or in use (a sequence using one keeps its bytes; nobody
        finds them by key again); how many."""
        n = 0
        for block in self.blocks:
            if block.key is not None and block.tenant == tenant:
                del self.by_key[block.key]
                block.key, block.tenant = None, ""
                n += 1
        return n

    def hold(self, block_ids: list[int]) -> None:
        """One more reference to each block in use (a fetch still writing into blocks whose sequence went away)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0 and block_id != NULL_BLOCK, f"block {block_id} held while not in use"
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference of each; a block reaching 0 goes to the free queue's tail (last evicted)."""
        for block_id in reversed(block_ids):  # tails first, so a prefix outlives its tail
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than referenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def clear_cache(self) -> int:
        """Forget every cached key of a free block (the device prefix cache empties); how many."""
        n = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.key is not None:
                del self.by_key[block.key]
                block.key, block.tenant = None, ""
                n += 1
        return n

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, used)."""
        cached = sum(1 for i in self.free_queue if self.blocks[i].key is not None)
        used = sum(1 for b in self.blocks[1:] if b.ref_count > 0)
        return len(self.free_queue) - cached, cached, used

    def check_integrity(self) -> None:
        """free + cached + used = total, and the key map agrees with the blocks."""
        free, cached, used = self.counts()
        assert free + cached + used == self.total, f"pool leak: {free} + {cached} + {used} != {self.total}"
        assert self.blocks[NULL_BLOCK].ref_count == 0 and NULL_BLOCK not in self.free_queue, "null block handed out"
        for key, block_id in self.by_key.items():
            assert self.blocks[block_id].key == key, "key map points at a block holding another key"
        assert sum(b.key is not None for b in self.blocks) == len(self.by_key), "a keyed block missing from the map"
