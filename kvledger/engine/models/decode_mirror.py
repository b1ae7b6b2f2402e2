"""A decode step's K and V read in place: compute-dtype copies of the running sequences' KV, heads first.

A full-attention layer keeps its KV in bf16 blocks scattered over the pool (`PagedKV`). For one query, a
step used to gather every position's blocks and widen them to the compute dtype, heads first, then attend:
three passes over the sequence's KV per layer per step, where the attention itself needs one. torch has no
CPU kernel that attends over paged bf16 blocks in place (vLLM's CPU backend has its own), so a layer keeps,
for each sequence decoding, a copy in the layout attention reads, and each step adds the one position it
wrote. SmolLM2 after 2,304 tokens, 2 threads: a decode step 63–69 → 54–57 ms, logits equal bit for bit
(`scripts/decode_step_ab.py mirror`, docs/engine.md).

    mirror = DecodeMirror(budget_bytes)
    mirror.retain(seqs)                        at each forward: drop the copies of sequences not decoding in it
    mirror.read(cache, seq, table, start, dt)  K, V [kv_heads, start + 1, head_dim] in `dt`, as
                                               `cache.gather_heads(table, start + 1, dt)` gives them

Invariant: an entry of sequence `seq` with `length` n holds exactly the blocks' values of positions [0, n),
widened. It is used only by a step of `seq` at position n, whose KV the layer has just written; any other
position rebuilds it from the blocks. A sequence's blocks below the position it computes never change
while it decodes, and a sequence that stops decoding (finished, preempted, prefilling again) is absent from
the next forward, so `retain` drops it. `seq` is unique for the life of the process (`Sequence.uid`); a
negative one is never mirrored. The entries of one layer hold at most `budget_bytes`: past it, a step reads
the blocks as before, which costs time and never correctness.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvledger.engine.models.base import PagedKV


@dataclass(slots=True)
class MirrorEntry:
    kv: torch.Tensor   # [2 (K, V), kv_heads, capacity, head_dim] in the compute dtype
    length: int        # positions [0, length) hold the blocks' values, widened

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class DecodeMirror:
    """One layer's copies, by sequence; `budget_bytes` bounds their sum (0: never mirror)."""

    def __init__(self, budget_bytes: int) -> None:
        assert budget_bytes >= 0, budget_bytes
        self.budget_bytes = budget_bytes
        self.entries: dict[int, MirrorEntry] = {}
        self.used_bytes = 0
        self.reads_in_place = 0   # steps that read an entry (the others gathered the blocks)

    def retain(self, seqs: Iterable[int]) -> None:
        """Keep the entries of `seqs` only: the sequences that decode in the forward about to run."""
        keep = set(seqs)
        for seq in [s for s in self.entries if s not in keep]:
            self.used_bytes -= self.entries.pop(seq).nbytes

    def read(self, cache: PagedKV, seq: int, block_table: torch.Tensor, start: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [0, start + 1) as [kv_heads, start + 1, head_dim] in `dtype`, for sequence `seq`'s
        one query at `start`, whose KV `cache` already holds. Views of the entry: valid until its next read."""
        end = start + 1
        entry = self.entries.get(seq)
        if entry is not None and entry.length == start and entry.kv.dtype == dtype and entry.kv.shape[2] >= end:
            block = int(block_table[start // cache.block_size])
            entry.kv[:, :, start].copy_(cache.kv[block, :, start % cache.block_size])   # [2, kv_heads, d]
            entry.length = end
            self.reads_in_place += 1
            return entry.kv[0, :, :end], entry.kv[1, :, :end]
        if entry is not None:
            self.used_bytes -= self.entries.pop(seq).nbytes
        room = self._room(seq, cache, end, dtype)
        k, v = cache.gather_heads(block_table, end, dtype, out=room)
        if room is not None:
            self.entries[seq] = MirrorEntry(room, end)
            self.used_bytes += self.entries[seq].nbytes
        return k, v

    def _room(self, seq: int, cache: PagedKV, end: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new entry's buffer for `end` positions and the next block and one more (a rebuild per block at
        most), if `seq` has an id and the budget has room for it."""
        capacity = (end // cache.block_size + 2) * cache.block_size
        shape = (2, cache.kv_heads, capacity, cache.head_dim)
        if seq < 0 or self.used_bytes + math.prod(shape) * torch.finfo(dtype).bits // 8 > self.budget_bytes:
            return None
        assert cache.kv is not None
        return torch.empty(shape, dtype=dtype, device=cache.kv.device)
