"""tiny-v4's forward over the engine's chunks and device caches (`base.Model.forward`).

Each chunk becomes one or two jobs, run layer by layer (so `before_layer(l)` can hold back layer l
until swap-in has its blocks). A job is the `TinyV4.step` arithmetic on a `SeqState` that is
loaded from the caches before each layer and written back after it:

    chunk [start, end), keep = keep_blocks_until      jobs
    start >= keep                                     [start, end)          compressors on
    start < keep (bounded replay, rule 3)             [start, min(end, keep)) windows only: entries
                                                      come from the blocks, never written
                                                      [keep, end) if end > keep  compressors on

The consumer layers compute rows from the YoCo anchor L − 134 (L = chunk.prompt_len) on, by
compaction (`yoco="compact"`). A chunk that ends before its anchor has no logits: its row is zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvledger.engine.models.base import BeforeLayer, Chunk
from kvledger.engine.models.tiny_v4_state import SeqState, Window, yoco_anchor

if TYPE_CHECKING:
    from kvledger.engine.models.tiny_v4 import TinyV4


@dataclass(slots=True)
class Job:
    """A run of one sequence's positions [lo, hi) through every layer."""

    chunk: int          # index of its chunk (logits row)
    slot: int
    block_table: Tensor
    lo: int
    hi: int
    compress: bool      # False: a bounded-replay job
    entries_to: int     # entries of positions before this come from the blocks
    state: SeqState
    x: Tensor | None = None   # encoder rows [lo, hi), then the consumer rows [max(lo, anchor), hi)
    h: Tensor | None = None   # the encoder's last hidden state, rows [lo, hi)

    @property
    def consumer_lo(self) -> int:
        return max(self.lo, self.state.anchor)


@torch.inference_mode()
def engine_forward(model: TinyV4, chunks: Sequence[Chunk], before_layer: BeforeLayer | None) -> Tensor:
    jobs = [job for c, chunk in enumerate(chunks) for job in _jobs(model, c, chunk)]
    for job in jobs:
        chunk = chunks[job.chunk]
        job.x = model.embed[chunk.tokens[job.lo - chunk.start:job.hi - chunk.start]]
    for i in range(model.spec.n_layers):
        if before_layer is not None:
            before_layer(i)
        for job in jobs:
            _run_layer(model, job, i)
    logits = torch.zeros(len(chunks), model.vocab_size, device=model.device)
    for job in jobs:
        if job.hi == chunks[job.chunk].end and job.x.shape[0]:
            logits[job.chunk] = model.head(job.x[-1:])[0].float()
    return logits


def _run_layer(model: TinyV4, job: Job, i: int) -> None:
    if i < model.encoder_layers:
        n0 = _load(model, job, i)
        job.x = model.encode(job.state, i, job.x, job.lo, job.compress)
        _store(model, job, i, n0, job.lo)
        if i == model.encoder_layers - 1:
            job.h = model.encoder_norm(job.x)
            job.x = job.x[job.consumer_lo - job.lo:]
        return
    if not job.compress and job.hi <= job.state.anchor:
        return  # a replay job: no consumer row, no entry to write
    n0 = _load(model, job, i)
    job.x = model.consume(job.state, i, job.h, job.x, job.consumer_lo, job.compress)
    _store(model, job, i, n0, job.consumer_lo)


def _jobs(model: TinyV4, c: int, chunk: Chunk) -> list[Job]:
    """The chunk's jobs (module docstring); resets the slot's rings where a sequence (re)starts them."""
    assert chunk.prompt_len > 0, "tiny-v4 needs the prompt length (its YoCo anchor) on every chunk"
    anchor, n = yoco_anchor(chunk.prompt_len, model.spec), model.spec.n_layers
    start, end, keep, s, slot = chunk.start, chunk.end, chunk.keep_blocks_until, chunk.truncate_from, chunk.slot
    encoder, consumers = model.caches[:model.encoder_layers], model.caches[model.encoder_layers:]
    if start == 0 or (s is not None and start == s):
        for cache in encoder:
            cache.reset(slot, start)
    if start <= anchor:
        for cache in consumers:
            cache.reset(slot, anchor)
    floor = max(s or 0, encoder[0].valid_from[slot])

    def job(lo: int, hi: int, compress: bool, entries_to: int) -> Job:
        state = SeqState(lo, anchor, floor, [None] * n, [None] * n, [None] * n, [None] * n, exact=floor == 0)
        return Job(c, slot, chunk.block_table, lo, hi, compress, entries_to, state)

    if start >= keep:
        return [job(start, end, True, start)]
    assert keep % model.spec.block_size == 0 and keep <= anchor, "replay ends at a block boundary before the anchor"
    return [job(start, min(end, keep), False, keep)] + ([job(keep, end, True, keep)] if end > keep else [])


def _load(model: TinyV4, job: Job, i: int) -> int:
    """Layer i's window, entries and open group from the caches into job.state; returns the entries read."""
    cache, state, window = model.caches[i], job.state, model.cfg.window
    state.pos = job.lo
    first = job.lo if i < model.encoder_layers else job.consumer_lo
    floor = cache.valid_from[job.slot]
    lo = max(floor, first - window + 1)
    state.windows[i] = Window(lo, cache.read_window(job.slot, lo, first))
    if cache.part is None:
        return 0
    count = job.entries_to // cache.ratio
    state.entries[i], state.index_keys[i] = cache.read_entries(job.block_table, count)
    state.tails[i] = cache.read_tail(job.slot, job.lo % cache.ratio) if job.compress else None
    return count


def _store(model: TinyV4, job: Job, i: int, n0: int, first: int) -> None:
    """Layer i's new window rows (from `first`), new entries and open group into the caches."""
    cache, state = model.caches[i], job.state
    window = state.windows[i]
    if window.end > first:
        cache.write_window(job.slot, first, window.rows(first, window.end))
    if cache.part is not None and job.compress:
        index = state.index_keys[i][n0:] if state.index_keys[i] is not None else None
        cache.write_entries(job.block_table, n0, state.entries[i][n0:], index)
        cache.write_tail(job.slot, state.tails[i])
    state.windows[i] = state.entries[i] = state.index_keys[i] = state.tails[i] = None
