"""`Engine`: the reference engine over the scheduler, loader, runner and writer (its records: api.py).

    engine = Engine(registry.DEFAULT_MODEL, block_ledger=BlockLedger.open(path=DIR))   # a name or a path
    keys, decision = check_prompt(tokens, engine.spec, block_ledger=..., state_ledger=None)
    engine.add_request(EngineRequest("r1", tokens, keys, decision, SamplingParams(max_tokens=32)))
    while engine.has_unfinished():
        for event in engine.step(): ...

Single-threaded: `add_request`, `step`, `abort` and `close` come from one thread. One step
collects finished fetches, schedules (blocks for each running sequence's next token, preempting the
most recently admitted when the pool has none; then decode, prefill chunks, admissions), runs one
forward (swap-in of fresh hits overlapped; in a step with nothing else to run, a hit's first forward
overlapped with its fetch, layer by layer: loader.py's streamed hits), samples, and writes back what
rule 4 and rule 7 ask. A
preempted sequence keeps its tokens, generator and usage, and is recomputed when readmitted
(loader.py's resume table; `preemption=False` reserves prompt + max_tokens up front instead). A failure
after the forward (sampling, write-back) ends only the sequence it belongs to, with finish_reason
"error"; the batch's others go on. Invariant when idle: every device block is free or
cached (`check_integrity`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from kvledger.core import (ModelSpec, chain_parent, checkpoint_positions, hit_cap, is_handed, tail_key, tail_parts,
                           takes_tail, tenant_of)
from kvledger.engine.api import EngineRequest, RequestUsage, TokenEvent
from kvledger.engine.block_pool import BlockPool
from kvledger.engine.defaults import DEFAULTS
from kvledger.engine.fetch_target import PoolTarget, StagingTarget
from kvledger.engine.fetcher import Fetcher
from kvledger.engine.loader import HitLoader
from kvledger.engine.models.registry import ModelEntry, resolve
from kvledger.engine.runner import ModelRunner, StepCost
from kvledger.engine.sampler import draw_generator, make_generator, sample_one
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import Sequence, SequenceStatus, new_uid
from kvledger.engine.shared_area import SharedArea
from kvledger.engine.state_slots import StateSlots
from kvledger.engine.swapin import SwapItem
from kvledger.engine.tails import TailStore
from kvledger.engine.threads import usable_cpus
from kvledger.engine.writer import LedgerWriter

FORGET_WAIT_S = 30.0   # a forget waits this long at most for the writer's queued puts (the store holds the rest)


def streams_by_default() -> bool:
    """Whether hits stream unless told (`Engine(stream_hits=None)`): when torch leaves a CPU of this process free
    for the fetcher. Measured (docs/engine.md, "A streamed hit"): with a core free a streamed hit took 0.93 of the
    same hit read first from the page cache and 0.63 from the disk; with both of 2 cores computing, the fetcher's
    copy and hash slow the forward as much as they save (0.88-1.02 warm, 0.75-1.48 from the disk)."""
    return torch.get_num_threads() < usable_cpus()


class StreamStalled(Exception):
    """A streamed hit's forward waited `stream_wait_s` for its parts: it is abandoned (`HitLoader.unstream`)."""


log = logging.getLogger("kvledger.engine")


class Engine:
    def __init__(self, model: str | ModelEntry, *, block_ledger: object | None, state_ledger: object | None = None,
                 device: str = DEFAULTS.device, max_num_seqs: int = DEFAULTS.max_num_seqs,
                 max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens, replay: bool = False,
                 fetcher: str = "process", kv_cache_bytes: int = DEFAULTS.kv_cache_bytes, fetch_timeout_s: float = 10.0,
                 checkpoint_every: int = DEFAULTS.checkpoint_every, max_seq_tokens: int | None = None,
                 preemption: bool = True, fetch_into: str | None = None, stream_hits: bool | None = None,
                 stream_wait_s: float = 1.0) -> None:
        """`checkpoint_every`: rule 4′'s periodic checkpointing, a snapshot every that many prompt tokens
        during prefill (a multiple of B; 0: only rule 4's, at the prompt's end); the `periodic:N` state
        strategy's N (`Strategy.checkpoint_every`). The device pool holds `kv_cache_bytes` of blocks, and at
        least one request of `max_seq_tokens` prompt + output tokens (default: the model's context; a server
        whose limits refuse longer requests may give less, so that a small pool can be asked for). `preemption`:
        admission reserves the prompt and a sequence takes blocks as it decodes, preempted by recompute when the
        pool runs out (True); or every request reserves prompt + max_tokens up front and none is preempted.
        `fetch_into`: where the fetcher reads hit blocks (`fetch_target`): "pool", straight into the device blocks
        (the default on the CPU), or "staging", then swapped in during the forward (the default, and the only
        choice, on a device). `stream_hits`: whether a hit's first forward may start while its blocks arrive
        (loader.py's streamed hits); None (the default): when torch computes on fewer threads than this process has
        CPUs, so that a core is left for the fetcher to read on (`streams_by_default`). `stream_wait_s`: the longest a
        streamed hit's forward waits for its parts in all before it is abandoned: what one fetch may hold up the
        requests that arrive meanwhile."""
        if fetcher not in ("process", "none"):
            raise ValueError("fetcher must be 'process' (its own process) or 'none' (no ledger reads)")
        fetch_into = fetch_into or ("pool" if torch.device(device).type == "cpu" else "staging")
        if fetch_into not in ("pool", "staging") or (fetch_into == "pool" and torch.device(device).type != "cpu"):
            raise ValueError("fetch_into must be 'staging', or 'pool' for a model on the CPU")
        self.model = (resolve(model) if isinstance(model, str) else model).load(device)
        self.spec: ModelSpec = self.model.spec
        checkpoint_positions(0, self.spec, checkpoint_every)   # ValueError unless at block boundaries
        self.checkpoint_every = checkpoint_every
        self.max_model_len = self.model.max_model_len
        self.eos_token_ids = tuple(self.model.eos_token_ids)
        block_bytes = self.spec.block_bytes()
        longest = self.max_model_len if max_seq_tokens is None else min(max_seq_tokens, self.max_model_len)
        num_blocks = max(kv_cache_bytes // block_bytes, -(-longest // self.spec.block_size) + 2)
        num_slots = max_num_seqs if self.spec.has_swa else 0
        fetches = block_ledger is not None and fetcher == "process"
        area = SharedArea(num_blocks * block_bytes, "kvledger-pool") if fetches and fetch_into == "pool" else None
        self.model.allocate(num_blocks, num_slots, area.buf if area is not None else None)
        self.pool = BlockPool(num_blocks)
        self.slots = StateSlots(num_slots, self.spec.state_size_to_disk() if self.spec.has_swa else 0)
        self.fetcher: Fetcher | None = None
        self.fetch_target: PoolTarget | StagingTarget | None = None
        if fetches:
            self.fetch_target = (PoolTarget(self.model, self.pool, num_blocks, area) if area is not None else
                                 StagingTarget(block_bytes, -(-self.max_model_len // self.spec.block_size)))
            self.fetcher = Fetcher(block_ledger, self.fetch_target.area, self.fetch_target.parts,
                                   timeout_s=fetch_timeout_s)
        self.loader = HitLoader(self.model, self.pool, self.slots, self.fetcher, self.fetch_target, state_ledger,
                                replay=replay, device_hits=block_ledger is not None, preemption=preemption,
                                stream_hits=streams_by_default() if stream_hits is None else stream_hits)
        self.writer = LedgerWriter(self.model, block_ledger, state_ledger, self.slots)
        self.tails = TailStore()   # P/D: prompt tails kept for the decode engine (keep_tail)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(self.model)
        self.orphans: list = []  # fetch jobs of aborted sequences, retired when they end
        self.last_cost = StepCost()
        self.preemptions = 0                  # sequences preempted so far (kvledger_engine_preemptions_total)
        self.streamed_hits = 0                # hits whose first forward ran while their blocks arrived
        self.stream_wait_s = stream_wait_s
        self.pending: list[TokenEvent] = []  # events owed to the next step (aborts)
        self.record_logits = False            # tests and bench: keep each request's first-token logits
        self.first_logits: dict[str, torch.Tensor] = {}

    # --- API -------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; ValueError when this engine cannot take it (its id is running, its tail is not one
        block's KV, it outgrows the device pool). The request itself was checked where it came in: its tokens,
        keys and decision by `entrypoint.prepare` (the embedded server) or `wire.GenerateBody.engine_request`
        (a cluster leg, once, as it enters the engine process)."""
        tokens = np.asarray(req.tokens)
        assert tokens.ndim == 1 and 0 < tokens.size < self.max_model_len, "prompt checked where it came in"
        if self.scheduler.find(req.request_id) is not None:
            raise ValueError(f"request {req.request_id!r} is already running")
        if req.tail_kv is not None or req.decision.hit_tokens > hit_cap(tokens.size, self.spec):
            self._check_tail(req, tokens.size)
        seq = Sequence.from_request(req)
        seq.checkpoints = checkpoint_positions(seq.prompt_len, self.spec, self.checkpoint_every,   # rules 4′, 4″, 12
                                               also=(req.public_blocks * self.spec.block_size, *req.snapshot_at))
        seq.block_size = self.spec.block_size
        if self.loader.lifetime_blocks(seq) > self.pool.total:
            raise ValueError(f"prompt + max_tokens needs {self.loader.lifetime_blocks(seq)} blocks; "
                             f"the device pool has {self.pool.total}")
        seq.generator = make_generator(req.sampling)
        self.scheduler.add(seq)

    def step(self, *, defer_stores: bool = False) -> list[TokenEvent]:
        """One batch forward; the events it produced. Blocks it finished are copied out for the block ledger
        before it returns, or with `defer_stores` at the next `flush_stores()` or step (the caller delivers the
        events first, so a first token does not wait on that copy)."""
        self.writer.flush()   # what an earlier step put off, before this one allocates a block
        events = self._step()
        if not defer_stores:
            self.writer.flush()
        return events

    def flush_stores(self) -> None:
        """Copy out the blocks a `step(defer_stores=True)` left for the block ledger (on the engine's thread)."""
        self.writer.flush()

    def _step(self) -> list[TokenEvent]:
        events, self.pending = self.pending, []
        swaps = self._collect_fetches()
        reserve = self.loader.reserve if self.loader.preemption else None
        batch = self.scheduler.schedule(self.loader.admit, reserve, self._preempt)
        swaps = [(seq, item) for seq, item in swaps if seq.status is SequenceStatus.RUNNING]  # not preempted
        streamed = self._stream() if not batch and not swaps else None
        if streamed is not None:
            batch = [(streamed, streamed.prefill_chunk(self.scheduler.max_num_batched_tokens))]
        if not batch and not swaps:
            if self.fetcher is not None and any(s.status is SequenceStatus.LOADING for s in self.scheduler.running):
                self.fetcher.poll(0.05)
            return events
        wait = self._part_wait(streamed) if streamed is not None else None
        try:
            logits, cost = self.runner.run(batch, [item for _, item in swaps], wait)
        except StreamStalled:
            self.loader.unstream(streamed)
            return events
        if streamed is not None and not self._streamed_intact(streamed):
            batch = []   # its forward read blocks that did not arrive intact: dropped; the lowered decision recomputes
        self.last_cost = cost
        for seq, _ in swaps:
            seq.add_time("swapin_s", cost.swapin_copy_s)
            seq.add_time("swapin_wait_s", cost.swapin_wait_s)
            self._retire_fetch(seq)
        for (seq, n), row in zip(batch, logits):
            event = self._advance_or_fail(seq, n, row, cost)
            if event is not None:
                events.append(event)
        return events

    def abort(self, request_id: str) -> None:
        """End a request now; its last event (finish_reason "abort") comes with the next step."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self._finish(seq, "abort", store=False)
            self.pending.append(TokenEvent(seq.request_id, (), True, "abort", self._usage(seq)))

    def hand_off(self, request_id: str) -> None:
        """End a request now, keeping its KV: the blocks computed so far go to the block ledger and
        the latest decode window to the state ledger (as at a normal end, rule 7), so another engine
        continues it from prompt + output with a hit. Its last event (finish_reason "handoff") comes
        with the next step; `wait_stored()` then makes the blocks findable."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self._finish(seq, "handoff", store=True)
            self.writer.flush()
            self.pending.append(TokenEvent(seq.request_id, (), True, "handoff", self._usage(seq)))

    def request_ids(self) -> list[str]:
        """Requests added and not finished, running first."""
        return [s.request_id for s in list(self.scheduler.running) + list(self.scheduler.waiting)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending)

    def close(self) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "abort", store=False)
        self.writer.flush()
        self.writer.wait()
        self.writer.close()
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetch_target.area.close()

    def wait_stored(self, timeout_s: float | None = None) -> bool:
        """Until every block queued for the block ledger so far is written (or its put failed), at most
        `timeout_s` seconds (None: no bound); whether they all were."""
        return self.writer.wait(timeout_s)

    def forget(self, tenant: str, wait_s: float = FORGET_WAIT_S) -> dict[str, int]:
        """Forget `tenant` in this engine (DESIGN rule 12; on the engine's thread): its requests running or waiting
        keep running and store nothing more (`Sequence.stores`), its puts not yet on the block ledger are dropped
        (waiting at most `wait_s` seconds for those already queued), and its device prefix cache entries, host pool
        snapshots (withdrawn from the directory) and P/D tails go. The counts, by what they were; `writes_pending`
        1 when the writer did not drain in time (what it still writes is refused by the store's hold)."""
        running = [s for s in (*self.scheduler.running, *self.scheduler.waiting)
                   if s.stores and tenant_of(s.request.namespace) == tenant]
        for seq in running:
            seq.stores = False
        puts, drained = self.writer.forget(tenant, wait_s)
        snapshots, pinned = self.writer.state_ledger.forget(tenant) if self.writer.state_ledger is not None else (0, 0)
        return {"running_requests": len(running), "puts_dropped": puts, "writes_pending": int(not drained),
                "device_blocks": self.pool.forget(tenant), "host_snapshots": snapshots, "pinned_snapshots": pinned,
                "tails": self.tails.forget(tenant)}

    def clear_device_cache(self) -> int:
        """Forget the device prefix cache (the next hit comes from the ledgers); blocks forgotten."""
        return self.pool.clear_cache()

    @property
    def hits_mode(self) -> str:
        """What the start-up lines say of `stream_hits`, as this model and pool allow it."""
        return "hits streamed" if self.loader.streams else "hits read before computing"

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        used = sum(1 for s in self.scheduler.running if s.slot >= 0)
        self.slots.check_integrity(used)

    # --- inside a step ------------------------------------------------------------

    def _collect_fetches(self) -> list[tuple[Sequence, SwapItem]]:
        """Sequences whose fetch ended become RUNNING; those with blocks to copy come back with them."""
        if self.fetcher is None:
            return []
        self.fetcher.poll(0.0)
        for job in [j for j in self.orphans if j.done]:
            self.fetcher.release(job)
            self.fetch_target.release(job, orphaned=True)
            self.orphans.remove(job)
        swaps = []
        for seq in self.scheduler.running:
            if seq.status is SequenceStatus.LOADING and seq.fetch_job.done:
                item = self.loader.on_fetched(seq)
                if item is None:
                    self._retire_fetch(seq)
                else:
                    swaps.append((seq, item))
        return swaps

    def _stream(self) -> Sequence | None:
        """In a step with nothing else to run, a LOADING sequence whose first forward starts now, while its blocks
        arrive (`HitLoader.stream`; the loader's "streamed hits")."""
        return next((seq for seq in self.scheduler.running if self.loader.stream(seq)), None)

    def _part_wait(self, seq: Sequence) -> Callable[[int], None]:
        """A streamed forward's wait before layer i: until the fetch has put that layer's part of every block in
        place (`PoolTarget.parts_before`), or ended; the time waited goes to the sequence's `fetch_wait_s`. Past
        `stream_wait_s` waited in all it raises `StreamStalled` (the forward is abandoned)."""
        job, parts_before = seq.fetch_job, self.fetch_target.parts_before
        left = [self.stream_wait_s]   # seconds of waiting left to this forward

        def wait(i: int) -> None:
            t = time.perf_counter()
            in_place = self.fetcher.wait_parts(job, parts_before[i], left[0])
            waited = time.perf_counter() - t
            seq.add_time("fetch_wait_s", waited)
            left[0] -= waited
            if not in_place:
                raise StreamStalled(seq.request_id)
        return wait

    def _streamed_intact(self, seq: Sequence) -> bool:
        """After a streamed forward: its fetch's answer (waited for); True when every block arrived intact and the
        forward stands. Otherwise `on_fetched` has lowered the decision and the forward must not be used."""
        job = seq.fetch_job
        self.fetcher.wait_done(job)
        self.loader.on_fetched(seq)
        self._retire_fetch(seq)
        self.streamed_hits += 1
        return job.intact == job.n

    def _advance_or_fail(self, seq: Sequence, n: int, logits: torch.Tensor, cost: StepCost) -> TokenEvent | None:
        """`_advance`; an exception in it ends this sequence alone (finish_reason "error", nothing more stored)."""
        try:
            return self._advance(seq, n, logits, cost)
        except Exception:
            log.exception("request %s failed after the forward; the batch's other requests go on", seq.request_id)
            if seq.status is not SequenceStatus.FINISHED:
                self._finish(seq, "error", store=False)
            return TokenEvent(seq.request_id, (), True, "error", self._usage(seq))

    def _advance(self, seq: Sequence, n: int, logits: torch.Tensor, cost: StepCost) -> TokenEvent | None:
        """Positions [computed, computed + n) are computed: write back what they complete, and sample when they
        reach the last token. Writes of a resume happen only past `high_water` (the first pass made the others)."""
        start, seen = seq.computed, seq.high_water
        seq.computed += n
        self._count_forward(seq, start, seen)
        if start < seq.prompt_len:
            seq.add_time("compute_s", cost.forward_s)
        if seq.computed in seq.checkpoints and seq.computed > seen:
            self.writer.store_checkpoint(seq, seq.computed)
        b = self.spec.block_size
        if start < seq.prompt_len <= seq.computed:
            self.writer.store_blocks(seq, seq.prompt_len // b)
            if seq.prompt_len > seen:
                self.writer.store_prefill_snapshots(seq)
            self._cache_blocks(seq)
            if seq.request.keep_tail and seq.prompt_len > seen:
                self._keep_tail(seq)
        elif self.spec.has_swa and seq.computed % b == 0 and seq.computed > seq.prompt_len:
            self.slots.copy_replica(self.model, seq.slot, seq.computed)
        if seq.computed < len(seq.tokens):
            return None
        return self._sample(seq, logits)

    def _count_forward(self, seq: Sequence, start: int, seen: int) -> None:
        """Prompt positions forwarded for the first time → prompt_forwarded; positions below the high-water
        mark forwarded again (a resume) → recomputed."""
        seq.prompt_forwarded += max(0, min(seq.computed, seq.prompt_len) - max(start, seen))
        seq.recomputed += max(0, min(seq.computed, seen) - start)
        seq.high_water = max(seen, seq.computed)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> TokenEvent:
        first = seq.first_token_at is None
        if first and self.record_logits:
            self.first_logits[seq.request_id] = logits.clone()
        draw = len(seq.tokens) - seq.request_prompt_len   # this token's index in the request's output
        token = sample_one(logits, seq.sampling, seq.tokens, draw_generator(seq.sampling, draw, seq.generator))
        seq.tokens.append(token)
        if first:
            seq.first_token_at = time.perf_counter()
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason, store=True)
        usage = self._usage(seq) if first or reason else None
        return TokenEvent(seq.request_id, (token,), reason is not None, reason, usage)

    def _check_tail(self, req: EngineRequest, prompt_len: int) -> None:
        """ValueError unless a request with a tail handed over, or a hit past `hit_cap`, has both: a decision
        `core.with_tail` made (hit L − 1) and the tail's bytes (`core.tail_parts`)."""
        if req.tail_kv is None:
            raise ValueError("a hit past the prompt's cap needs its tail handed over with it")
        if not is_handed(req.decision, prompt_len, self.spec):
            raise ValueError("a tail handed over comes with the hit core.with_tail makes (L − 1)")
        block, window = tail_parts(prompt_len, self.spec)
        if len(req.tail_kv) != block + window:
            raise ValueError(f"a tail handed over is {block} bytes of its last block and {window} of its window")

    def _keep_tail(self, seq: Sequence) -> None:
        """P/D: the tail of the prompt (`core.tail_parts` for the decode leg's L = prompt + 1: the block the prompt
        ends in, then the windows at its end) kept for the decode engine by `core.tail_key` (engine/tails.py).
        Nothing to keep for V4 (`core.takes_tail`), a full-attention prompt of whole blocks, or a sequence that
        does not keep what it computes (`Sequence.keeps`: rules 9 and 12)."""
        b, n = self.spec.block_size, seq.prompt_len
        block, window = tail_parts(n + 1, self.spec)
        if not takes_tail(self.spec) or not block + window or not seq.keeps:
            return
        whole = n // b
        parent = chain_parent(self.spec, seq.request.namespace, seq.keys[:whole],
                              public_blocks=seq.request.public_blocks)
        kv = bytearray(block + window)
        if block:
            kv[:block] = self.writer.export_blocks([seq.block_table[whole]]).tobytes()
        if window:
            self.model.export_window(seq.slot, n, torch.frombuffer(kv, dtype=torch.uint8, offset=block))
        self.tails.put(tail_key(parent, seq.tokens[whole * b:n]), kv, tenant_of(seq.request.namespace))

    def _retire_fetch(self, seq: Sequence) -> None:
        """The fetched blocks are on the device (or not needed): free the staging, if any."""
        self.fetcher.release(seq.fetch_job)
        self.fetch_target.release(seq.fetch_job, orphaned=False)
        seq.fetch_job = None

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output) >= sp.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _cache_blocks(self, seq: Sequence) -> None:
        """Full blocks computed so far become findable in the device prefix cache by chain key; of a sequence
        that is not exact (rule 9) only those it reused, never one it computed; of one that does not store (rule
        12: no-store, or its tenant forgotten) none (those it found on the device stay there as they were)."""
        if not seq.stores:
            return
        full = seq.computed // self.spec.block_size
        if not seq.exact:
            full = min(full, seq.decision.reused_block_tokens // self.spec.block_size)
        self.writer.ensure_keys(seq, full)
        for i in range(full):
            self.pool.cache(seq.block_table[i], seq.keys[i], seq.owner(i))

    def _finish(self, seq: Sequence, reason: str, *, store: bool) -> None:
        seq.finish_reason = reason
        if store and seq.block_table:
            self.writer.store_blocks(seq, seq.computed // self.spec.block_size)
            self.writer.store_replica(seq)
            self._cache_blocks(seq)
        self._drop_fetch(seq)
        if seq.block_table:
            self.loader.release(seq)
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)

    def _drop_fetch(self, seq: Sequence) -> None:
        """The sequence no longer waits for its fetch: let its rows go now, or when the job ends (orphans: the
        fetcher may still write them, `fetch_target`)."""
        if seq.fetch_job is None:
            return
        if seq.fetch_job.done:
            self._retire_fetch(seq)
            return
        self.fetch_target.orphan(seq.fetch_job)
        self.orphans.append(seq.fetch_job)
        seq.fetch_job = None

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute (the scheduler chose `seq` and requeues it): its full blocks computed so far stay
        findable in the device prefix cache, as at a normal end (an inexact one's: only those it reused, rule 9);
        blocks, slot and fetch are given back; tokens, generator and usage are kept. Nothing is cached before its
        first forward (a LOADING sequence's blocks were never swapped in)."""
        if seq.high_water > 0 and seq.block_table:
            self._cache_blocks(seq)
        self._drop_fetch(seq)
        if seq.block_table or seq.slot >= 0:
            self.loader.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.uid = new_uid()   # its next admission recomputes: no decode mirror of this one may serve it
        seq.preemptions += 1
        self.preemptions += 1

    def _usage(self, seq: Sequence) -> RequestUsage:
        ttft = seq.first_token_at - seq.arrival if seq.first_token_at is not None else None
        device = min(seq.device_hit_blocks * self.spec.block_size, seq.cached_tokens)
        return RequestUsage(seq.prompt_len, seq.cached_tokens, len(seq.output), seq.decision.kind.value, ttft,
                            dict(seq.timings), device, fetch_bytes=seq.fetch_bytes,
                            fetch_misses=dict(seq.fetch_misses), computed_prompt_tokens=seq.prompt_forwarded,
                            preemptions=seq.preemptions, recomputed_tokens=seq.recomputed)
