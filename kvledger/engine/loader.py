"""The hit path into the device (rules 3, 6, 8): admission, snapshot, fetch, and what a fault lowers.

Admitting a sequence with decision d (from the entrypoint's CHECK):

    | step                   | what                                                              |
    |------------------------|-------------------------------------------------------------------|
    | slot                   | a state slot (SWA models); the snapshot at L1 via                 |
    |                        |   `StateLedger.fetch_into` → `Model.import_window` (SNAPSHOT only) |
    | blocks [0, ⌈hit/B⌉)    | leading ones found in the device pool by chain key; the rest are  |
    |                        |   fetched from the block ledger by the fetcher process            |
    | blocks [⌈hit/B⌉, end)  | fresh blocks for the computed part and the decode                 |
    | once fetched           | on the CPU the blocks are in place (read into them); on a device, |
    |                        |   swap-in from staging, layer by layer during the first forward   |
    |                        |   (`fetch_target`); then compute from d.recompute_from            |

A full-attention hit of L − 1 (a prompt of whole blocks, all present: `core.hit_cap`) takes the last
block whole and computes one token into it. That block is the request's own: fetched into a fresh block,
or, found in the device prefix cache, copied into one first (copy on write), so a shared block is never
written. A P/D decode leg whose prefill engine handed over the prompt's tail (`core.with_tail`,
`EngineRequest.tail_kv`, `core.tail_parts`) also computes one token: its whole blocks come as above, the
tail's block part is written into the fresh block after them (in no ledger until it fills), and a windowed
model's windows at L − 1 go into its slot, as a snapshot at L − 1 would (`handed_tail`).

A streamed hit (rule 6's overlap; the CPU pool, full attention): when nothing else would run in a step, a sequence
still LOADING starts its first forward anyway (`stream`), as if every block will arrive; the fetcher reads its
blocks part by part (layer by layer) and the forward waits for each layer's part before computing that layer
(`Engine.step`). Once the forward ends the job's answer decides: all intact, the forward stands; otherwise its
result is dropped and the decision is lowered as below, exactly as if the fetch had ended first (`on_fetched`).
A forward that waits longer than `Engine(stream_wait_s=...)` in all for parts is abandoned (`unstream`): no step
holds up the requests that arrive meanwhile for longer than that; the sequence waits for its fetch as LOADING.
Nothing else of the forward outlives it: the KV it wrote lies in the sequence's own blocks, at positions the
lowered decision computes again. Windowed models wait for the whole fetch (their windows and snapshots are not
rolled back), and so does every hit on a CPU that may reorder stores (`fetcher.STREAMS_HERE`). With other
sequences to run, a hit waits too: no request's tokens wait on another's fetch.

A fault lowers the decision and never fails the request (rule 8): a snapshot that does not
arrive, or a block that does not arrive intact (missing, corrupt, fetcher dead or hung) →
decide again with the blocks that did arrive and no snapshot: the fallback (or replay) for a
model that takes it, an exact replay from 0 over those blocks for every other windowed model
(rule 3′), the blocks alone for a full-attention one. `cached_tokens` reports what was
actually reused. A windowed model keeps one spare block per sequence: if a lowered fallback must
recompute a block shared through the device prefix cache, the sequence takes the spare instead
of writing into the shared one (an exact replay rewrites none).

Blocks reserved at admission (`blocks_needed`), + 1 spare for a windowed model:

    | policy                   | blocks                             | later                                 |
    |--------------------------|------------------------------------|---------------------------------------|
    | preemption (default)     | ⌈(len(tokens) + 1) / B⌉: the prompt | `reserve` takes one more when the next |
    |                          |   (or prompt + output) and the     |   token starts a block; the scheduler |
    |                          |   first decode step                |   preempts when the pool has none     |
    | no preemption            | ⌈(prompt + max_tokens) / B⌉        | nothing (all reserved up front)       |

Both capped at the context. A request whose prompt + max_tokens alone exceed the pool is refused at
`Engine.add_request` under both.

Readmitting a preempted sequence of n = len(tokens) tokens (`_resume`): only exact paths, only blocks the
device prefix cache still holds (nothing is fetched), and the decision, `cached_tokens` and
`device_hit_blocks` of its first admission stay as they were (a resume's reuse is no prompt cache hit):

    | the sequence               | held leading blocks looked up | resumes at                             |
    |----------------------------|-------------------------------|----------------------------------------|
    | exact, full attention      | keys[:(n − 1) // B] (output   | h·B, computing [h·B, n)                |
    |                            |   blocks too)                 |                                        |
    | exact, windowed            | keys[:cap_blocks(L)]          | q: the latest snapshot ≤ h·B the state |
    |                            |   (the prompt's only: the     |   ledger holds, blocks [0, q) held;    |
    |                            |   window of a later position  |   none (or it does not arrive): the    |
    |                            |   is not stored whole)        |   exact replay of [0, n) over the held |
    |                            |                               |   blocks (`core.exact_replay`)         |
    | not exact (a fallback or   | those its decision reused     | its own decision again, the same       |
    |   a bounded replay first)  |                               |   truncation (what an unpreempted run  |
    |                            |                               |   computes); some gone: from 0, exact  |

Rule 3's fallback is never taken on a resume. The resume's chunks end at the prompt's end (rule 4's
windows) and at the last block boundary in the output (the decode replica), as a first run's did.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvledger.core import (HitDecision, blocks_spanned, cap_blocks, decide_hit, decided_length, exact_replay, is_handed,
                           lookup_hit, resumes_exactly, tail_parts)
from kvledger.engine.block_pool import BlockPool
from kvledger.engine.fetch_target import PoolTarget, StagingTarget
from kvledger.engine.fetcher import STREAMS_HERE, Fetcher
from kvledger.engine.models.base import Model
from kvledger.engine.sequence import Sequence, SequenceStatus
from kvledger.engine.state_slots import StateSlots
from kvledger.engine.swapin import SwapItem


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a preempted sequence resumes (module docstring's resume table): its first `blocks` blocks are held
    device blocks, block KV below `keep_until` is read and never written, computation restarts at `start`.
    Invariant: start <= blocks · B, and keep_until <= blocks · B."""

    start: int
    blocks: int
    keep_until: int = 0
    truncate_from: int | None = None


class HitLoader:
    def __init__(self, model: Model, pool: BlockPool, slots: StateSlots, fetcher: Fetcher | None,
                 target: PoolTarget | StagingTarget | None, state_ledger: object | None, *, replay: bool,
                 device_hits: bool = True, preemption: bool = True, stream_hits: bool = True) -> None:
        assert (fetcher is None) == (target is None), "a fetcher reads into a target"
        self.model, self.spec, self.pool, self.slots = model, model.spec, pool, slots
        self.fetcher, self.target, self.state_ledger, self.replay = fetcher, target, state_ledger, replay
        self.device_hits = device_hits   # False: a no-cache baseline, every prompt computed as decided
        self.preemption = preemption     # False: reserve prompt + max_tokens at admission (the old policy)
        self.faults: Counter[str] = Counter()
        # hits whose first forward may run while their blocks arrive (module docstring: streamed hits)
        self.streams = stream_hits and isinstance(target, PoolTarget) and not self.spec.has_swa and STREAMS_HERE

    def lifetime_blocks(self, seq: Sequence) -> int:
        """Blocks of the whole request: prompt + max_tokens (capped at the context), + 1 spare if windowed."""
        tokens = min(seq.prompt_len + seq.sampling.max_tokens, self.model.max_model_len)
        return blocks_spanned(tokens, self.spec) + (1 if self.spec.has_swa else 0)

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks reserved at admission (module docstring): the tokens so far and the next step's, with
        preemption; the whole request's without."""
        if not self.preemption:
            return self.lifetime_blocks(seq)
        tokens = min(len(seq.tokens) + 1, seq.prompt_len + seq.sampling.max_tokens, self.model.max_model_len)
        return blocks_spanned(tokens, self.spec) + (1 if self.spec.has_swa else 0)

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for what the sequence's next step computes, [computed, len(tokens)): one more from the pool
        when its next token starts a new block; False (nothing taken) when the pool has none free."""
        need = blocks_spanned(len(seq.tokens), self.spec) - len(seq.block_table)
        if need <= 0:
            return True
        if self.pool.num_free() < need:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def admit(self, seq: Sequence) -> bool:
        """Allocate and start loading (a preempted sequence: resume); False (nothing held) when blocks, slot or
        staging are short."""
        if seq.high_water > 0:
            return self._resume(seq)
        slot = self._slot_if_room(self.blocks_needed(seq))
        if slot is None:
            return False
        if self.device_hits:
            seq.decision = self._with_device_cache(seq)
        seq.handed_tail = seq.request.tail_kv is not None   # `Engine.add_request` checked it against the decision
        tail_block, tail_window = tail_parts(seq.prompt_len, self.spec) if seq.handed_tail else (0, 0)
        decision = seq.decision if seq.handed_tail else self._snapshot(seq, slot)
        hit_blocks = self._ledger_blocks(seq, decision)
        on_device = self.pool.lookup(seq.keys[:hit_blocks])
        # a hit ending inside its last block writes that block: one found on the device is copied first
        partial = decision.reused_block_tokens % self.spec.block_size != 0 and not tail_block
        copy_last = partial and len(on_device) == hit_blocks
        need = self.blocks_needed(seq) - len(on_device) + copy_last
        if self.pool.num_free() < need:
            self.pool.free(on_device)
            self.slots.release(slot)
            return False
        seq.block_table = on_device + self.pool.allocate(need)
        if copy_last:
            self._copy_on_write(seq, hit_blocks - 1)
        if seq.handed_tail:
            tail = torch.frombuffer(bytearray(seq.request.tail_kv), dtype=torch.uint8)
            if tail_block:   # the block after the ledger blocks is the request's own: the block part goes in
                self.model.import_block(seq.block_table[hit_blocks], tail[:tail_block])
            if tail_window:   # the windows at L − 1 are this hit's snapshot (`core.with_tail`)
                self.model.import_window(slot, decision.hit_tokens, tail[tail_block:].to(self.model.device))
        seq.slot, seq.device_hit_blocks, seq.decision = slot, len(on_device), decision
        missing = seq.keys[len(on_device):hit_blocks]
        if missing and self.fetcher is not None:
            rows = self.target.rows(seq.block_table[len(on_device):hit_blocks])
            if rows is None:  # staging full: wait for a later step
                self.release(seq)
                return False
            seq.fetch_job = self.fetcher.submit(missing, rows, by_part=self.streams)
            seq.status = SequenceStatus.LOADING
            return True
        if missing:  # no fetcher: recompute from the first block not on the device
            decision = self._lower(seq, len(on_device), "no_fetcher")
        self._start(seq, decision)
        return True

    def _slot_if_room(self, blocks: int) -> int | None:
        """A state slot for an admission (-1: the model keeps none) when `blocks` blocks are free and a slot is;
        None (nothing taken) otherwise."""
        if self.pool.num_free() < blocks:
            return None
        return self.slots.allocate() if self.spec.has_swa else -1

    def _decided(self, seq: Sequence) -> int:
        """The length the hit rule decides this sequence on (`core.decided_length`: a later leg of a model anchored
        at its prompt is decided as its prompt is)."""
        return decided_length(seq.prompt_len, seq.request_prompt_len, self.spec)

    def _with_device_cache(self, seq: Sequence) -> HitDecision:
        """The device prefix cache may hold more leading blocks than the CHECK found: blocks this engine
        computed whose write to the block ledger is still queued. Taking them reads no KV from anywhere,
        so the decision is raised to them (`core.lookup_hit`, the CHECK's lookup, over the state ledger)."""
        d, b = seq.decision, self.spec.block_size
        held = self.pool.cached_prefix(seq.keys[:cap_blocks(self._decided(seq), self.spec)])
        if min(held * b, d.cap) <= d.block_hit_tokens:
            return d
        ledger = self.state_ledger
        snapshots = None if ledger is None else lambda at: ledger.positions(seq.keys, at=at)
        better = lookup_hit(seq.prompt_len, held, snapshots, self.spec, replay=self.replay,
                            request_prompt_len=seq.request_prompt_len).decision
        return better if better.hit_tokens > d.hit_tokens else d

    def _snapshot(self, seq: Sequence, slot: int) -> HitDecision:
        d = seq.decision
        if not d.swa_hit:
            return d
        if not self._import_snapshot(seq.keys[d.block_hit_tokens // self.spec.block_size - 1], slot,
                                     d.block_hit_tokens):
            return self._lower(seq, d.block_hit_tokens // self.spec.block_size, "snapshot")
        return d

    def _import_snapshot(self, key: bytes, slot: int, position: int) -> bool:
        """The state ledger's snapshot of chain key `key` into `slot`'s window at `position`; whether it arrived
        whole."""
        buf = self.slots.staging
        got = None
        if self.state_ledger is not None:
            got = self.state_ledger.fetch_into(key, memoryview(buf.numpy()))
        if got != buf.numel():
            return False
        self.model.import_window(slot, position, buf.to(self.model.device))
        return True

    # --- resume after a preemption (module docstring's resume table) ---------------------

    def _resume(self, seq: Sequence) -> bool:
        """Readmit a preempted sequence at its `ResumePoint`; False (nothing held) when blocks or slot are short."""
        need = self.blocks_needed(seq)
        slot = self._slot_if_room(need)
        if slot is None:
            return False
        held = self.pool.lookup(self._resume_keys(seq))
        point = self._resume_point(seq, slot, len(held))
        self.pool.free(held[point.blocks:])
        held = held[:point.blocks]
        if self.pool.num_free() < need - len(held):
            self.pool.free(held)
            self.slots.release(slot)
            return False
        seq.block_table = held + self.pool.allocate(need - len(held))
        seq.slot, seq.computed = slot, point.start
        seq.keep_blocks_until, seq.truncate_from = point.keep_until, point.truncate_from
        seq.status = SequenceStatus.RUNNING
        return True

    def _resume_keys(self, seq: Sequence) -> list[bytes]:
        """The chain keys of the leading blocks a resume may take from the device (resume table)."""
        if not seq.exact:
            return seq.keys[:blocks_spanned(seq.decision.reused_block_tokens, self.spec)]
        if self.spec.has_swa:
            return seq.keys[:cap_blocks(self._decided(seq), self.spec)]
        return seq.keys[:(len(seq.tokens) - 1) // self.spec.block_size]

    def _resume_point(self, seq: Sequence, slot: int, held: int) -> ResumePoint:
        """Where to resume with `held` leading blocks on the device: an exact path only (resume table)."""
        b = self.spec.block_size
        if not seq.exact:
            return self._resume_inexact(seq, held)
        if not self.spec.has_swa:
            return ResumePoint(held * b, held)
        q = self._resume_snapshot(seq, slot, held * b)
        if q:
            return ResumePoint(q, q // b)
        d = exact_replay(self._decided(seq), held, self.spec)
        return ResumePoint(d.recompute_from, held, keep_until=d.reused_block_tokens)

    def _resume_snapshot(self, seq: Sequence, slot: int, l1: int) -> int:
        """The latest snapshot position q <= l1 of this prompt that the state ledger holds, imported into `slot`;
        0 when there is none or it does not arrive (the resume replays exactly instead)."""
        if self.state_ledger is None or l1 == 0:
            return 0
        b = self.spec.block_size
        q = max(self.state_ledger.positions(seq.keys, at=range(b, l1 + 1, b)), default=0)
        if q and self._import_snapshot(seq.keys[q // b - 1], slot, q):
            return q
        if q:
            self.faults["resume_snapshot"] += 1
        return 0

    def _resume_inexact(self, seq: Sequence, held: int) -> ResumePoint:
        """A sequence that was not exact from its start: its own decision again (the same truncation) when the
        device still holds the blocks it reused; otherwise an exact recompute from 0 (counted as a fault)."""
        d = seq.decision
        if held == blocks_spanned(d.reused_block_tokens, self.spec):
            return ResumePoint(d.recompute_from, held, d.reused_block_tokens if d.replay else 0, d.truncate_from)
        self.faults["resume_lost"] += 1
        return ResumePoint(0, 0)

    def _lower(self, seq: Sequence, blocks: int, cause: str) -> HitDecision:
        """A fault: decide again with only `blocks` leading blocks in hand and no snapshot (rule 8). A model that
        does not fall back keeps its blocks and replays exactly from 0 (rule 3′: `exact_replay`)."""
        self.faults[cause] += 1
        if resumes_exactly(self.spec, replay=self.replay):
            return exact_replay(self._decided(seq), blocks, self.spec)
        return decide_hit(self._decided(seq), blocks, set(), self.spec, replay=self.replay)

    def stream(self, seq: Sequence) -> bool:
        """Start a LOADING sequence's first forward before its fetch ends, as if every block will arrive (module
        docstring: streamed hits); False (nothing changed) when it may not. Its fetch job stays with it: the engine
        waits per layer (`Fetcher.wait_parts`) and for the answer (`on_fetched`) before using the forward."""
        job = seq.fetch_job
        if not (self.streams and seq.status is SequenceStatus.LOADING and job is not None and not job.done
                and not seq.stream_stalled):
            return False
        self._start(seq, seq.decision)
        return True

    def unstream(self, seq: Sequence) -> None:
        """An abandoned streamed forward (module docstring): back to LOADING, for good. What the forward wrote lies
        in the sequence's own blocks and is computed again; `on_fetched` starts it afresh."""
        assert seq.fetch_job is not None and seq.status is SequenceStatus.RUNNING
        seq.status, seq.stream_stalled = SequenceStatus.LOADING, True
        self.faults["stream_stalled"] += 1

    def on_fetched(self, seq: Sequence) -> SwapItem | None:
        """The fetch of `seq` ended: lower on a short read; the blocks swap-in copies, if any (none when the fetcher
        read them into the sequence's own blocks: `PoolTarget`; blocks past a short read are computed over). For a
        streamed hit, after its forward: the decision is the same one (`_start` again changes nothing) unless a
        block did not arrive intact."""
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
        staged = self.target.staged(job, take) if take else None
        return None if staged is None else SwapItem(staged, seq.block_table[dev:dev + take])

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
        but for the block part of a tail handed over (P/D), which is in no ledger (unless a fault lowered `d`)."""
        spanned = blocks_spanned(d.reused_block_tokens, self.spec)
        handed = seq.handed_tail and is_handed(d, seq.prompt_len, self.spec)
        return spanned - 1 if handed and d.hit_tokens % self.spec.block_size else spanned

    def release(self, seq: Sequence) -> None:
        """Give back blocks and slot (the fetch job, if any, is the engine's to retire)."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        self.slots.release(seq.slot)
        seq.slot = -1
