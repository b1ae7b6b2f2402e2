"""Which part of a block's KV each vLLM worker holds under tensor and pipeline parallelism, and its key.

A ledger block is the KV of 128 tokens in every full-attention layer of the model. Under tensor parallelism of
degree T a worker holds the model's KV heads [r·H/T, (r + 1)·H/T) (H KV heads; when H < T each head is replicated
on T/H workers and worker r holds head r // (T/H), as vLLM's `QKVParallelLinear` splits them); under pipeline
parallelism its stage's layers. Its part of a block is a `KvSlice`, and a part's bytes are laid out as the whole
block's (vLLM's CPU layout per layer and block is [heads, 128, 2·head_dim], head-major, so a head range of a layer
is one contiguous byte range):

    part of slice (heads [h0, h1), layers [l0, l1)):
    | layer l0: heads h0..h1 | layer l0 + 1: heads h0..h1 | … |      each (h1 − h0) · head_bytes,
                                                                     head_bytes = 128 · 2 · head_dim · dtype size

Rule 11: a key names the slice. A part's key is the block's chain key for the whole block (one worker holds
everything: the keys and files are those of an engine without parallelism) and H("kvledger/slice" ‖ chain key ‖
h0, h1, l0, l1) for any other slice, so no worker reads another's bytes, and a replicated head is one part, stored
by the first of its replicas only.

Engines of different degrees share one prefix cache: a block is present for a reader when every part of some
partition of the whole block (a set of slices that covers every head of every layer once) is, and each worker
copies the heads it holds out of the parts that hold them. `Slicing.partitions` lists the partitions a reader
tries, its own first, then the whole block and each head split into T' equal ranges (T' dividing H), over all layers.

| writer \\ reader | T = 1                     | T = 2 (H = 4)                     |
|-----------------|---------------------------|-----------------------------------|
| T = 1           | the block (one part)      | each worker: its 2 heads of it    |
| T = 2           | both parts, heads side by side | each worker: its own part    |

No vLLM import: the main test suite reads this module.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from kvledger.core import KEY_BYTES


@dataclass(frozen=True, slots=True)
class KvSlice:
    """KV heads [head0, head1) of full-attention layers [layer0, layer1) (model order) of one block.

    Invariant: 0 <= head0 < head1 and 0 <= layer0 < layer1."""

    head0: int
    head1: int
    layer0: int
    layer1: int

    def __post_init__(self) -> None:
        assert 0 <= self.head0 < self.head1 and 0 <= self.layer0 < self.layer1, self

    @property
    def heads(self) -> int:
        return self.head1 - self.head0

    @property
    def layers(self) -> int:
        return self.layer1 - self.layer0

    def overlaps(self, other: KvSlice) -> bool:
        return (self.head0 < other.head1 and other.head0 < self.head1
                and self.layer0 < other.layer1 and other.layer0 < self.layer1)


_SLICE = struct.Struct("<IIII")


def head_range(kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The KV heads [h0, h1) TP rank `tp_rank` of `tp_size` holds (vLLM's split; replicated when kv_heads < tp_size).

    Example, H = 4: T = 2 → rank 1 holds [2, 4); H = 1, T = 2 → both ranks hold [0, 1)."""
    assert 0 <= tp_rank < tp_size
    if kv_heads >= tp_size:
        assert kv_heads % tp_size == 0, f"{kv_heads} KV heads do not split into {tp_size} ranks"
        per = kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    assert tp_size % kv_heads == 0, f"{tp_size} ranks do not share {kv_heads} KV heads evenly"
    head = tp_rank // (tp_size // kv_heads)
    return head, head + 1


def first_replica(kv_heads: int, tp_rank: int, tp_size: int) -> bool:
    """Whether this rank is the first of those holding its heads: the one that stores them (stored once)."""
    return kv_heads >= tp_size or tp_rank % (tp_size // kv_heads) == 0


@dataclass(frozen=True, slots=True)
class Slicing:
    """The model's KV heads and full-attention layers, the slices of one engine, and one worker's own.

    `kv_heads`, `n_layers`: the whole model's KV heads and full-attention layers (a block is every head of each of
    them; a hybrid model's windowed layers are in no block); `engine`: the slices the
    engine's workers hold together, one per distinct slice (its own partition of the block); `own`: this worker's
    (None in the scheduler); `head_bytes`: one head of one layer of one block (128 · 2 · head_dim · dtype size).
    Invariant: `engine` is a partition of the whole block; `own` is in it."""

    kv_heads: int
    n_layers: int
    head_bytes: int
    engine: tuple[KvSlice, ...]
    own: KvSlice | None = None
    stores: bool = True   # this worker stores its slice (False for a replica of a head another worker stores)

    def __post_init__(self) -> None:
        assert self.kv_heads > 0 and self.n_layers > 0 and self.head_bytes > 0
        assert is_partition(self.engine, self.kv_heads, self.n_layers), f"not a partition: {self.engine}"
        assert self.own is None or self.own in self.engine

    @classmethod
    def whole(cls, kv_heads: int, n_layers: int, head_bytes: int) -> Slicing:
        """One worker holds the whole block (no tensor or pipeline parallelism)."""
        s = KvSlice(0, kv_heads, 0, n_layers)
        return cls(kv_heads, n_layers, head_bytes, (s,), s)

    @property
    def everything(self) -> KvSlice:
        return KvSlice(0, self.kv_heads, 0, self.n_layers)

    def part_bytes(self, s: KvSlice) -> int:
        return s.heads * s.layers * self.head_bytes

    def key(self, chain_key: bytes, s: KvSlice) -> bytes:
        """The key of slice `s` of the block under `chain_key`: the chain key itself for the whole block."""
        if s == self.everything:
            return chain_key
        h = hashlib.sha256(b"kvledger/slice\0" + chain_key + _SLICE.pack(s.head0, s.head1, s.layer0, s.layer1))
        return h.digest()[:KEY_BYTES]

    def partitions(self) -> tuple[tuple[KvSlice, ...], ...]:
        """The partitions a reader looks for, in order: the engine's own, then the whole block, then every split of
        the heads into t equal ranges (t dividing kv_heads) over all layers; each once."""
        found = [self.engine]
        for t in range(1, self.kv_heads + 1):
            if self.kv_heads % t == 0:
                per = self.kv_heads // t
                p = tuple(KvSlice(i * per, (i + 1) * per, 0, self.n_layers) for i in range(t))
                if p not in found:
                    found.append(p)
        return tuple(found)

    def reads(self, partition: tuple[KvSlice, ...]) -> tuple[KvSlice, ...]:
        """The parts of `partition` this worker reads: those overlapping its own slice."""
        assert self.own is not None, "a worker's slicing"
        return tuple(s for s in partition if s.overlaps(self.own))

    def copy_part(self, part: np.ndarray, s: KvSlice, row: np.ndarray) -> None:
        """Copy what part `part` (of slice `s`, uint8) holds of this worker's slice into `row` (its own part)."""
        own = self.own
        assert own is not None and s.overlaps(own)
        assert part.nbytes == self.part_bytes(s) and row.nbytes == self.part_bytes(own)
        h0, h1 = max(s.head0, own.head0), min(s.head1, own.head1)
        n = (h1 - h0) * self.head_bytes
        src_layer, dst_layer = s.heads * self.head_bytes, own.heads * self.head_bytes
        src_at, dst_at = (h0 - s.head0) * self.head_bytes, (h0 - own.head0) * self.head_bytes
        for layer in range(max(s.layer0, own.layer0), min(s.layer1, own.layer1)):
            src = (layer - s.layer0) * src_layer + src_at
            dst = (layer - own.layer0) * dst_layer + dst_at
            row[dst:dst + n] = part[src:src + n]


def is_partition(slices: tuple[KvSlice, ...], kv_heads: int, n_layers: int) -> bool:
    """Whether `slices` cover every (head, layer) of the block exactly once."""
    seen = np.zeros((kv_heads, n_layers), dtype=np.int32)
    for s in slices:
        if s.head1 > kv_heads or s.layer1 > n_layers:
            return False
        seen[s.head0:s.head1, s.layer0:s.layer1] += 1
    return bool((seen == 1).all())


def engine_slices(kv_heads: int, tp_size: int, stages: tuple[tuple[int, int], ...]) -> tuple[KvSlice, ...]:
    """The distinct slices of an engine of TP degree `tp_size` whose pipeline stages hold layers `stages`
    ([l0, l1) each, in order): one per (distinct head range, stage)."""
    heads = sorted({head_range(kv_heads, r, tp_size) for r in range(tp_size)})
    return tuple(KvSlice(h0, h1, l0, l1) for l0, l1 in stages for h0, h1 in heads)
