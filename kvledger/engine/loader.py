"""The hit path into the device (rules 3, 6, 8): admission, snapshot, fetch, and what a fault lowers.

Admitting a sequence with decision d (from the entrypoint's CHECK):

    | step                   | what                                                              |
    |------------------------|-------------------------------------------------------------------|
    | slot                   | a state slot (SWA models); the snapshot at L1 via                 |
    |                        |   `StateLedger.fetch_into` → `Model.import_window` (SNAPSHOT only) |
    | blocks [0, ⌈hit/B⌉)    | leading ones found in the device pool by chain key; the rest are  |
    |                        |   fetched from the block ledger by the fetcher process            |
    | blocks [⌈hit/B⌉, end)  | fresh blocks for the computed part and the decode                 |
    | once fetched           | swap-in (layer by layer, during the first forward), then compute  |
    |                        |   from d.recompute_from                                           |

A full-attention hit of L − 1 (a prompt of whole blocks, all present: `core.hit_cap`) takes the last
block whole and computes one token into it. That block is the request's own: fetched into a fresh block,
or, found in the device prefix cache, copied into one first (copy on write), so a shared block is never
written. A P/D decode leg whose prefill engine handed over the prompt's tail (`core.with_tail`,
`EngineRequest.tail_kv`) also computes one token: its whole blocks come as above, and the tail is
written into the fresh block after them (`handed_tail`); that block is in no ledger until it fills.

A fault lowers the decision and never fails the request (rule 8): a snapshot that does not
arrive, or a block that does not arrive intact (missing, corrupt, fetcher dead or hung) →
decide again with the blocks that did arrive and no snapshot: the fallback (or replay) for a
model that takes it, an exact replay from 0 over those blocks for every other windowed model
(rule 3′), the blocks alone for a full-attention one. `cached_tokens` reports what was
actually reused. A windowed model keeps one spare block per sequence: if a lowered fallback must
recompute a block shared through the device prefix cache, the sequence takes the spare instead
of writing into the shared one (an exact replay rewrites none).
"""

from __future__ import annotations

from collections import Counter

import torch

from kvledger.core import (HitDecision, blocks_spanned, cap_blocks, decide_hit, exact_replay, hit_cap,
                           resumes_exactly, snapshot_candidates)
from kvledger.engine.block_pool import BlockPool
from kvledger.engine.fetcher import Fetcher
from kvledger.engine.models.base import Model
from kvledger.engine.sequence import Sequence, SequenceStatus
from kvledger.engine.state_slots import StateSlots
from kvledger.engine.swapin import SwapItem


class HitLoader:
    def __init__(self, model: Model, pool: BlockPool, slots: StateSlots, fetcher: Fetcher | None,
                 state_ledger: object | None, *, replay: bool, device_hits: bool = True) -> None:
        self.model, self.spec, self.pool, self.slots = model, model.spec, pool, slots
        self.fetcher, self.state_ledger, self.replay = fetcher, state_ledger, replay
        self.device_hits = device_hits   # False: a no-cache baseline, every prompt computed as decided
        self.faults: Counter[str] = Counter()

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks reserved at admission: prompt + max_tokens (capped at the context), + 1 spare if windowed."""
        tokens = min(seq.prompt_len + seq.sampling.max_tokens, self.model.max_model_len)
        return -(-tokens // self.spec.block_size) + (1 if self.spec.has_swa else 0)

    def admit(self, seq: Sequence) -> bool:
        """Allocate and start loading; False (nothing held) when blocks, slot or staging are short."""
        if self.pool.num_free() < self.blocks_needed(seq):
            return False
        slot = -1
        if self.spec.has_swa:
            slot = self.slots.allocate()
            if slot is None:
                return False
        if self.device_hits:
            seq.decision = self._with_device_cache(seq)
        decision = self._snapshot(seq, slot)
        seq.handed_tail = seq.request.tail_kv is not None and decision.hit_tokens > hit_cap(seq.prompt_len, self.spec)
        hit_blocks = blocks_spanned(decision.reused_block_tokens, self.spec) - seq.handed_tail   # ledger blocks
        on_device = self.pool.lookup(seq.keys[:hit_blocks])
        # a hit ending inside its last block writes that block: one found on the device is copied first
        partial = decision.reused_block_tokens % self.spec.block_size != 0 and not seq.handed_tail
        copy_last = partial and len(on_device) == hit_blocks
        need = self.blocks_needed(seq) - len(on_device) + copy_last
        if self.pool.num_free() < need:
            self.pool.free(on_device)
            self.slots.release(slot)
            return False
        seq.block_table = on_device + self.pool.allocate(need)
        if copy_last:
            self._copy_on_write(seq, hit_blocks - 1)
        if seq.handed_tail:   # the block after the ledger blocks is the request's own: the tail goes in
            tail = torch.frombuffer(bytearray(seq.request.tail_kv), dtype=torch.uint8)
            self.model.import_block(seq.block_table[hit_blocks], tail)
        seq.slot, seq.device_hit_blocks, seq.decision = slot, len(on_device), decision
        missing = seq.keys[len(on_device):hit_blocks]
        if missing and self.fetcher is not None:
            job = self.fetcher.submit(missing)
            if job is None:  # staging full: wait for a later step
                self.release(seq)
                return False
            seq.fetch_job, seq.status = job, SequenceStatus.LOADING
            return True
        if missing:  # no fetcher: recompute from the first block not on the device
            decision = self._lower(seq, len(on_device), "no_fetcher")
        self._start(seq, decision)
        return True

    def _with_device_cache(self, seq: Sequence) -> HitDecision:
        """The device prefix cache may hold more leading blocks than the CHECK found: blocks this engine
        computed whose write to the block ledger is still queued. Taking them reads no KV from anywhere,
        so the decision is raised to them (the snapshot, for windowed models, looked up as the CHECK does)."""
        d, b = seq.decision, self.spec.block_size
        held = self.pool.cached_prefix(seq.keys[:cap_blocks(seq.prompt_len, self.spec)])
        if min(held * b, d.cap) <= d.block_hit_tokens:
            return d
        snapshots: set[int] = set()
        if self.spec.has_swa and self.state_ledger is not None:
            at = snapshot_candidates(seq.prompt_len, held, self.spec, replay=self.replay)
            snapshots = self.state_ledger.positions(seq.keys, at=at)
        better = decide_hit(seq.prompt_len, held, snapshots, self.spec, replay=self.replay)
        return better if better.hit_tokens > d.hit_tokens else d

    def _snapshot(self, seq: Sequence, slot: int) -> HitDecision:
        d = seq.decision
        if not d.swa_hit:
            return d
        key = seq.keys[d.block_hit_tokens // self.spec.block_size - 1]
        buf = self.slots.staging
        got = None
        if self.state_ledger is not None:
            got = self.state_ledger.fetch_into(key, memoryview(buf.numpy()))
        if got != buf.numel():
            return self._lower(seq, d.block_hit_tokens // self.spec.block_size, "snapshot")
        self.model.import_window(slot, d.block_hit_tokens, buf.to(self.model.device))
        return d

    def _lower(self, seq: Sequence, blocks: int, cause: str) -> HitDecision:
        """A fault: decide again with only `blocks` leading blocks in hand and no snapshot (rule 8). A model that
        does not fall back keeps its blocks and replays exactly from 0 (rule 3′: `exact_replay`)."""
        self.faults[cause] += 1
        if resumes_exactly(self.spec, replay=self.replay):
            return exact_replay(seq.prompt_len, blocks, self.spec)
        return decide_hit(seq.prompt_len, blocks, set(), self.spec, replay=self.replay)

    def on_fetched(self, seq: Sequence) -> SwapItem | None:
        """The fetch of `seq` ended: lower on a short read; the blocks swap-in copies, if any."""
        job = seq.fetch_job
        assert job is not None and job.done and self.fetcher is not None
        seq.add_time("fetch_s", job.fetch_s)
        seq.fetch_bytes += job.bytes_read
        for cause, n in job.misses.items():
            seq.fetch_misses[cause] = seq.fetch_misses.get(cause, 0) + n
        dev, decision = seq.device_hit_blocks, seq.decision
        if job.intact < job.n:
            decision = self._lower(seq, dev + job.intact, "block")
            self._unshare(seq, decision.reused_block_tokens)  # block KV is written from there on
        take = max(self._ledger_blocks(seq, decision) - dev, 0)
        self._start(seq, decision)
        if take == 0:
            return None
        return SwapItem(self.fetcher.view(job)[:take], seq.block_table[dev:dev + take])

    def _copy_on_write(self, seq: Sequence, i: int) -> None:
        """Block i of `seq`, from the device prefix cache, becomes a copy of its own (the last block allocated
        for it goes there): the request writes into the copy, the shared one stays as it is."""
        shared, own = seq.block_table[i], seq.block_table.pop()
        self.model.copy_block(shared, own)
        self.pool.free([shared])
        seq.block_table[i] = own

    def _unshare(self, seq: Sequence, written_from: int) -> None:
        """Blocks from the device prefix cache whose block KV a lowered decision rewrites → the spare.
        (A replay reads the block before its hit and never writes it: that one stays shared.)"""
        first = written_from // self.spec.block_size
        for i in range(first, seq.device_hit_blocks):
            assert self.spec.has_swa and i == seq.device_hit_blocks - 1, "a lowered hit recomputes one block at most"
            spare = seq.block_table.pop()
            self.pool.free([seq.block_table[i]])
            seq.block_table[i] = spare
        seq.device_hit_blocks = min(seq.device_hit_blocks, first)

    def _start(self, seq: Sequence, d: HitDecision) -> None:
        seq.decision = d
        seq.computed = d.recompute_from
        seq.cached_tokens = d.hit_tokens
        seq.keep_blocks_until = d.reused_block_tokens if d.replay else 0
        seq.truncate_from = d.truncate_from
        seq.stored_blocks = self._ledger_blocks(seq, d)  # put_chain skips blocks already stored
        seq.status = SequenceStatus.RUNNING

    def _ledger_blocks(self, seq: Sequence, d: HitDecision) -> int:
        """The leading blocks of hit `d` that come from the ledgers (or the device cache): every block it spans,
        but for a tail handed over (P/D), which is in no ledger."""
        spanned = blocks_spanned(d.reused_block_tokens, self.spec)
        return spanned - 1 if seq.handed_tail and d.hit_tokens > hit_cap(seq.prompt_len, self.spec) else spanned

    def release(self, seq: Sequence) -> None:
        """Give back blocks and slot (the fetch job, if any, is the engine's to retire)."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        self.slots.release(seq.slot)
        seq.slot = -1
