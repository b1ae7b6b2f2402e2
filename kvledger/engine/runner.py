"""The model runner: one forward over a scheduled batch, with the swap-in of fresh hits layer by layer.

For each (sequence, n) of the batch it builds a `Chunk` over tokens [computed, computed + n);
sequences whose fetch just ended bring `SwapItem`s, and one `SwapIn` copies all of them while
the forward computes (the forward waits per layer in `before_layer`); a streamed hit brings its
own `before_layer` instead (the fetch's parts, `Engine.step`). It returns the last position's
logits per sequence and what the step cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvledger.engine.models.base import BeforeLayer, Chunk, Model
from kvledger.engine.sequence import Sequence
from kvledger.engine.swapin import SwapIn, SwapItem


@dataclass(slots=True)
class StepCost:
    forward_s: float = 0.0     # the forward pass, swap-in waits included
    swapin_copy_s: float = 0.0  # time the copier spent copying (hidden or not)
    swapin_wait_s: float = 0.0  # time the forward blocked on swap-in (not hidden)


class ModelRunner:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.device = model.device

    def chunk(self, seq: Sequence, n: int) -> Chunk:
        dev = self.device
        start = seq.computed
        tokens = torch.tensor(seq.tokens[start:start + n], dtype=torch.long, device=dev)
        table = torch.tensor(seq.block_table, dtype=torch.long, device=dev)
        return Chunk(tokens, start, table, seq.slot, seq.keep_blocks_until, seq.truncate_from, seq.request_prompt_len,
                     seq.uid)

    def run(self, batch: list[tuple[Sequence, int]], swaps: list[SwapItem],
            before_layer: BeforeLayer | None = None) -> tuple[torch.Tensor, StepCost]:
        """float32 host logits [len(batch), vocab] and the step's cost. `before_layer`: a wait of the caller's
        before each layer (a streamed hit), with no swaps."""
        assert not (swaps and before_layer), "one wait per layer: the swap-in's or the caller's"
        chunks = [self.chunk(seq, n) for seq, n in batch]
        cost = StepCost()
        t0 = time.perf_counter()
        swap = SwapIn(self.model.caches, swaps, self.device).start() if swaps else None
        try:
            logits = self.model(chunks, swap.before_layer if swap else before_layer)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            if swap is not None:
                swap.finish()
        cost.forward_s = time.perf_counter() - t0
        if swap is not None:
            cost.swapin_copy_s, cost.swapin_wait_s = swap.copy_s, swap.wait_s
        return logits.float().cpu(), cost
