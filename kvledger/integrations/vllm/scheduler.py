"""Scheduler side of the connector: the CHECK, and each step's loads and saves.

A thin adapter: the hit comes from the block ledger's metadata (`exists`, no KV byte
read); keys are `core.chain_keys` of the request's token ids in the request's namespace
(its `cache_salt`).

The hit is core's rule (`core.hit_cap`): for a full-attention model every leading block present,
less the last prompt token, which vLLM must compute for its logits: min(cached · B, L − 1). It
differs from a block-aligned cap ⌊(L − 1)/B⌋ · B only for a prompt of whole blocks that are all
present: the last block is then loaded whole and vLLM computes one token into it, rewriting that
token's slot, instead of recomputing all B tokens (the block is this request's own vLLM block,
shared with nobody yet). A 4,096-token hit of SmolLM2 under
vLLM's CPU build took ~2.7 s with the block-aligned cap, nearly all of it those 128
tokens, and ~0.16 s with this one (docs/vllm.md).

Ranges, in tokens, for one request (B = 128):

| range                      | what                                                              |
|----------------------------|-------------------------------------------------------------------|
| [0, local)                 | vLLM's own prefix cache hit (whole blocks): neither loaded nor saved |
| [local, local + external)  | loaded in the request's first step, as whole blocks (the last one |
|                            | may end one token past the range)                                 |
| [computed, computed + new) | computed this step; the full blocks that end in it, unless loaded |
|                            | whole this step, are saved                                        |

A preempted request comes back through the CHECK; its block list is replaced, and a
load that failed leaves vLLM recomputing from the failed block, which is then saved.

A hybrid model (full and sliding-window layers, vLLM's hybrid KV cache manager on: one block
table per KV cache group) asks the state ledger too, and the hit is core's rule 3′ as it is
(`lookup_hit` over the leading blocks and the state ledger's snapshot positions;
for Gemma 3, R = 1: a hit at L1 = ⌊(L − 1)/B⌋·B needs the snapshot at L1, else the latest
earlier one q, and the hit is q). Its ranges, W the window:

| range                       | what                                                             |
|-----------------------------|------------------------------------------------------------------|
| [local, hit)                | full group: ledger blocks, loaded whole                          |
| [hit − W, hit) ∩ [local, …) | sliding-window groups: the snapshot at `hit` (their blocks before |
|                             | it are vLLM's null blocks: outside every later query's window)   |
| x in rules 4′/4″ positions  | saved after the step whose tokens start before x and end at or   |
|                             | past it: vLLM still holds the blocks of [x − W, x) then (that    |
|                             | step's first query attends back to x − W; vLLM frees a sliding   |
|                             | block only once the processed tokens leave it behind)            |

Its loads are vLLM's asynchronous loads: with several KV cache groups vLLM takes load failures
per request, not per block id, and a failed one is recomputed from 0 (exact, rule 8).

Under tensor or pipeline parallelism each worker holds a slice of a block, stored as a part under a key of
its own (`slices.py`): the CHECK counts a block only when every part of one partition of it is present (the
engine's own first, then another degree's), remembers which per block, and the load carries it to the workers
(`BlockRun.sources`), each of which reads the parts holding its heads.

vLLM objects are duck-typed here (`request.request_id`, `.prompt_token_ids`,
`.all_token_ids`, `.cache_salt`; the scheduler output's fields), so this module imports
no vLLM and the main test suite drives it with plain records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvledger.core import (PUBLIC_NAMESPACE, ModelSpec, checkpoint_positions, continue_chain, lookup_hit,
                           prefill_store_positions)
from kvledger.integrations.vllm.config import namespace_of
from kvledger.integrations.vllm.records import BlockRun, KvGroups, StepPlan, WindowRun
from kvledger.integrations.vllm.slices import Slicing
from kvledger.state.ledger import StateLedger
from kvledger.store.ledger import BlockLedger
from kvledger.util.public_prefix import PublicPrefixes

log = logging.getLogger("kvledger.vllm")


@dataclass(slots=True)
class RequestTrack:
    """What the scheduler side knows of one live request.

    `keys[i]` is the chain key of block i of `request.all_token_ids` (grown as the request
    decodes); `block_ids[i]` the vLLM block holding it. `pending_load` is the number of
    tokens vLLM was told to load, consumed by the next step that schedules the request.
    """

    request: Any
    namespace: str
    public_blocks: int = 0          # leading blocks of a published public prefix (rule 12, `core.chain_parent`)
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pending_load: int = 0
    load_ids: tuple[int, ...] = ()  # vLLM blocks of the load in flight (to map reported failures)
    load_tokens: int = 0            # tokens vLLM counts as loaded by it
    loaded_tokens: int = 0
    failed_blocks: int = 0
    window_ids: list[list[int]] = field(default_factory=list)
    async_load: tuple[BlockRun | None, WindowRun] | None = None
    window_at: int = 0              # the snapshot position a load restored (0: none)


def cacheable(request: Any) -> bool:
    """Whether token ids alone name the request's KV: not for prompt embeddings, multimodal inputs
    (placeholder tokens stand for different images) or LoRA adapters (other weights)."""
    return (request.prompt_token_ids is not None and getattr(request, "prompt_embeds", None) is None
            and not getattr(request, "mm_features", None) and getattr(request, "lora_request", None) is None)


class SchedulerSide:
    """CHECK and step planning; one instance lives in vLLM's scheduler process."""

    def __init__(self, ledger: BlockLedger, spec: ModelSpec, *, state: StateLedger | None = None,
                 groups: KvGroups | None = None, slicing: Slicing | None = None,
                 public: PublicPrefixes | None = None) -> None:
        groups = groups or KvGroups()
        assert spec.has_swa == (state is not None) == bool(groups.windows), \
            "a model with sliding-window layers has sliding-window groups and a state ledger, and only it"
        assert state is None or slicing is None or len(slicing.engine) == 1, "a hybrid model runs unsliced"
        self.ledger = ledger
        self.public = public or PublicPrefixes(spec.block_size)   # the operator's published prefixes (rule 12)
        self.slicing = slicing
        # The partitions a block may be read from, own first (None: the block's chain key only, one part).
        self.partitions = slicing.partitions() if slicing is not None and state is None else None
        self.sources: dict[str, tuple[int, ...]] = {}  # req_id → its last CHECK's partition per leading block
        self.state = state
        self.groups = groups
        self.spec = spec
        self.block = spec.block_size
        self.tracks: dict[str, RequestTrack] = {}
        self.n_groups = 1 + len(groups.windows)        # every group is the full one or a window one
        self.checked: dict[str, tuple[int, int]] = {}  # req_id → (vLLM's local hit, the hit) of its last CHECK
        self.branches: dict[str, int] = {}             # req_id → its last CHECK's branch point (rule 4″; 0: none)

    @property
    def loads_async(self) -> bool:
        """Loads are vLLM's asynchronous loads, reported per request (a hybrid model; module docstring)."""
        return self.spec.has_swa

    # --- CHECK (reads metadata only; a hybrid CHECK remembers its answer for the allocation) ---

    def cached_blocks(self, token_ids: Sequence[int], namespace: str) -> int:
        """Leading blocks of the prompt present in the ledger, from metadata only (no TTL refresh)."""
        return len(self._leading(self._chain(token_ids, namespace)))

    def _public_blocks(self, token_ids: Sequence[int]) -> int:
        return self.public.blocks(np.asarray(token_ids, dtype=np.uint32)) if self.public.prefixes else 0

    def _chain(self, token_ids: Sequence[int], namespace: str) -> list[bytes]:
        """The prompt's chain keys: a published prefix's blocks under the public root, the rest the namespace's."""
        return continue_chain(token_ids, self.spec, namespace, [], public_blocks=self._public_blocks(token_ids))

    def _leading(self, keys: list[bytes]) -> tuple[int, ...]:
        """Per leading block present, the partition (index into `partitions`) it is read from. A block counts only
        when every part of one partition is present, so every worker finds the heads and layers it holds (rule 10);
        unsliced, a block is its chain key's (index 0).

        Runs of blocks: the engine's own partition from block 0 as far as it holds them; at the first block it
        lacks, the first partition that holds that block whole (one query over every partition's parts of that
        block), as far as that one holds them; and so on. A cold miss costs two queries."""
        found: list[int] = []
        index: int | None = 0
        own = True   # this run is the engine's own partition from block 0 (it may hold none)
        try:
            while index is not None and len(found) < len(keys):
                run = self._run_present(index, keys[len(found):])
                if not run and not own:   # the holder just found lost the block (evicted meanwhile): stop there
                    break
                found += [index] * run
                index = self._holder(keys[len(found)]) if len(found) < len(keys) else None
                own = False
        except Exception as e:  # rule 8: an unreachable index is a miss
            log.warning("kvledger: CHECK failed (%s); treating as a miss", e)
            return ()
        return tuple(found)

    def _run_present(self, index: int, keys: list[bytes]) -> int:
        """Leading blocks of `keys` whose every part of partition `index` is present."""
        parts = self._part_keys(index, keys)
        flags = self.ledger.exists([k for part in parts for k in part])
        n = 0
        while n < len(keys) and all(flags[i * len(keys) + n] for i in range(len(parts))):
            n += 1
        return n

    def _holder(self, key: bytes) -> int | None:
        """The first partition holding every part of the block under chain key `key` (None: none does)."""
        if self.partitions is None:
            return None
        parts = [self._part_keys(index, [key]) for index in range(len(self.partitions))]
        flags = iter(self.ledger.exists([k for p in parts for (k,) in p]))
        whole = [all([next(flags) for _ in p]) for p in parts]
        return whole.index(True) if any(whole) else None

    def _part_keys(self, index: int, keys: list[bytes]) -> list[list[bytes]]:
        """Per part of partition `index`, the keys of the blocks `keys` (unsliced: the chain keys, one part)."""
        if self.partitions is None:
            return [keys]
        assert self.slicing is not None
        return [[self.slicing.key(k, s) for k in keys] for s in self.partitions[index]]

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond vLLM's local hit the ledgers can supply: min(cached · B, L − 1) for a full-attention
        model, rule 3′ over the blocks and the snapshots for a hybrid one (module docstring)."""
        if not cacheable(request):
            return 0
        prompt = request.prompt_token_ids
        keys = self._chain(prompt, namespace_of(request.cache_salt))
        sources = self._leading(keys)
        cached = len(sources)
        self.sources[request.request_id] = sources
        state = self.state
        snapshots = None if state is None else lambda at: state.positions(keys, at=at)   # metadata only
        lookup = lookup_hit(len(prompt), cached, snapshots, self.spec)
        hit = lookup.decision.hit_tokens
        if state is not None:
            self.checked[request.request_id] = (num_computed_tokens, hit)
            self.branches[request.request_id] = lookup.branch_point(self.spec)
        return max(hit - num_computed_tokens, 0)

    # --- allocation and steps ------------------------------------------------------

    def after_alloc(self, request: Any, num_external_tokens: int,
                    block_ids: Sequence[Sequence[int]] | None = None) -> None:
        """vLLM allocated blocks for `request` (`block_ids`: per KV cache group, all of the request's)
        and will count `num_external_tokens` as loaded."""
        if not cacheable(request):
            assert num_external_tokens == 0, "no hit is offered for a request whose KV the token ids do not name"
            return
        track = self.tracks.get(request.request_id)
        if track is None:
            track = RequestTrack(request, namespace_of(request.cache_salt),
                                 self._public_blocks(request.prompt_token_ids))
            self.tracks[request.request_id] = track
        if self.loads_async and num_external_tokens:
            assert block_ids is not None, "an asynchronous load is planned from the allocation"
            self._plan_async_load(track, num_external_tokens, block_ids)
            return
        track.pending_load = num_external_tokens

    def _plan_async_load(self, track: RequestTrack, external: int, block_ids: Sequence[Sequence[int]]) -> None:
        """A hybrid model's load of [local, hit): the full group's blocks and the window at `hit`."""
        local, hit = self.checked.pop(track.request.request_id)
        assert hit - local == external and local % self.block == 0 == hit % self.block, \
            "vLLM loads what the CHECK offered, from a block boundary to a snapshot position"
        self._take_ids(track, block_ids, replace=True)
        run = self._run(track, track.request.request_id, local // self.block, hit // self.block)
        window = self._window(track, hit, skip_before=local)
        assert window is not None, "a hit at a snapshot position has its window's blocks"
        track.async_load = (run, window)
        if run is not None:
            self._refresh(track, run.end)
            track.load_ids = run.block_ids
        track.load_tokens, track.window_at = external, hit
        track.loaded_tokens += external

    def _take_ids(self, track: RequestTrack, block_ids: Sequence[Sequence[int]], *, replace: bool) -> None:
        """A request's vLLM blocks, per group: all of them (`replace`), or the step's new ones."""
        if replace:
            track.block_ids = list(block_ids[self.groups.full])
            track.window_ids = [list(block_ids[g]) for g in self.groups.windows]
            return
        track.block_ids.extend(block_ids[self.groups.full])
        for ids, g in zip(track.window_ids, self.groups.windows):
            ids.extend(block_ids[g])

    def _window(self, track: RequestTrack, position: int, *, skip_before: int = 0) -> WindowRun | None:
        """The window at boundary `position` (min(W, position) tokens before it) in the request's blocks;
        None when a sliding-window group lacks them. `skip_before`: tokens vLLM's own cache holds."""
        assert self.spec.window is not None and position % self.block == 0
        n = min(self.spec.window, position) // self.block
        first, end = position // self.block - n, position // self.block
        if any(len(ids) < end for ids in track.window_ids):
            return None
        keys = self._keys(track, end)
        skip = max(skip_before // self.block - first, 0)
        return WindowRun(track.request.request_id, keys[end - 1], position,
                         tuple(tuple(ids[first:end]) for ids in track.window_ids), skip)

    def plan_step(self, out: Any) -> StepPlan:
        """The loads and saves of one scheduler step (`out` is vLLM's SchedulerOutput)."""
        loads: list[BlockRun] = []
        saves: list[BlockRun] = []
        window_loads: list[WindowRun] = []
        window_saves: list[WindowRun] = []
        for track in self.tracks.values():   # hybrid: the loads planned at allocation (their requests wait)
            if track.async_load is not None:
                run, window = track.async_load
                track.async_load = None
                loads.extend([run] if run is not None else [])
                window_loads.append(window)
        for req in out.scheduled_new_reqs:
            track = self.tracks.get(req.req_id)
            if track is not None:
                self._take_ids(track, req.block_ids, replace=True)
                self._plan(track, req.req_id, req.num_computed_tokens, out.num_scheduled_tokens, loads, saves)
                self._plan_windows(track, req.num_computed_tokens, out.num_scheduled_tokens, window_saves)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self.tracks.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:   # resumed: the full lists, replaced
                self._take_ids(track, new_ids or [[] for _ in range(self.n_groups)], replace=True)
            elif new_ids:
                self._take_ids(track, new_ids, replace=False)
            self._plan(track, req_id, cached.num_computed_tokens[i], out.num_scheduled_tokens, loads, saves)
            self._plan_windows(track, cached.num_computed_tokens[i], out.num_scheduled_tokens, window_saves)
        return StepPlan(tuple(loads), tuple(saves), tuple(window_loads), tuple(window_saves),
                        by_request=self.loads_async)

    def _plan_windows(self, track: RequestTrack, computed: int, scheduled: dict[str, int],
                      window_saves: list[WindowRun]) -> None:
        """Rules 4′ and 4″: the windows at the prompt's store positions (a published prefix's end, the branch point
        its CHECK found) that this step's tokens complete."""
        if self.state is None:
            return
        end = computed + scheduled.get(track.request.request_id, 0)
        n = len(track.request.prompt_token_ids)
        also = (track.public_blocks * self.block, self.branches.get(track.request.request_id, 0))   # rules 12, 4″
        for x in sorted({*prefill_store_positions(n, self.spec), *checkpoint_positions(n, self.spec, 0, also=also)}):
            if computed < x <= end:
                window = self._window(track, x)
                if window is None:
                    log.warning("kvledger: no vLLM blocks for the window at %d of %s; no snapshot saved",
                                x, track.request.request_id)
                else:
                    window_saves.append(window)

    def _plan(self, track: RequestTrack, req_id: str, computed: int, scheduled: dict[str, int],
              loads: list[BlockRun], saves: list[BlockRun]) -> None:
        track.load_ids = ()  # failures of the previous step's load were reported before this step
        first = computed // self.block       # the first block that ends after `computed`
        if track.pending_load:
            run = self._load_run(track, req_id, computed)
            if run is not None:
                loads.append(run)
                first = run.end              # a block loaded whole is not saved back
        new = scheduled.get(req_id, 0)
        last = (computed + new) // self.block  # blocks that end by the step's end are full
        public = track.public_blocks   # a published prefix's blocks are saved as the public namespace's
        for lo, hi in ((first, min(last, public)), (max(first, public), last)):
            run = self._run(track, req_id, lo, hi)
            if run is not None:
                saves.append(run)

    def _load_run(self, track: RequestTrack, req_id: str, computed: int) -> BlockRun | None:
        """The blocks holding [computed − pending, computed), the tokens vLLM counts as loaded this step: whole
        blocks, the last one past `computed` when the hit stops one token short of a block's end."""
        external, track.pending_load = track.pending_load, 0
        start = computed - external
        assert start % self.block == 0, "vLLM's local hit and a ledger hit start on a block boundary"
        assert computed % self.block in (0, self.block - 1), "a ledger hit ends on a block or one token short"
        run = self._run(track, req_id, start // self.block, -(-computed // self.block), load=True)
        if run is not None:
            self._refresh(track, run.end)
            track.load_ids, track.load_tokens = run.block_ids, external
            track.loaded_tokens += external
        return run

    def _run(self, track: RequestTrack, req_id: str, first: int, last: int, *, load: bool = False) -> BlockRun | None:
        """Blocks [first, last) of the request as one run (None when empty); a load's carries the partition
        its CHECK found each block in."""
        if last <= first:
            return None
        keys = self._keys(track, last)
        assert len(keys) >= last and len(track.block_ids) >= last, "a block to move has a key and a vLLM block"
        sources: tuple[int, ...] = ()
        if load and self.partitions is not None:
            found = self.sources.get(req_id, ())
            assert len(found) >= last, "a loaded block was present at the CHECK"
            sources = found[first:last] if any(found[first:last]) else ()
        namespace = PUBLIC_NAMESPACE if last <= track.public_blocks else track.namespace
        return BlockRun(req_id, namespace, first, tuple(keys[first:last]),
                        tuple(track.block_ids[first:last]), keys[first - 1] if first else None, sources)

    def _keys(self, track: RequestTrack, n_blocks: int) -> list[bytes]:
        """The first `n_blocks` keys of the request, extending the chain from its last key."""
        if len(track.keys) < n_blocks:
            track.keys = continue_chain(track.request.all_token_ids, self.spec, track.namespace, track.keys,
                                        public_blocks=track.public_blocks, upto=n_blocks)
        return track.keys

    def _refresh(self, track: RequestTrack, n_blocks: int) -> None:
        """A hit pushes its blocks' expiry out (TTL class of the namespace): every part of each partition it
        reads from, as far as that part's chain leads from position 0 (a part read from a partition that lacks
        earlier blocks is refreshed with the next hit that reads them all there)."""
        keys = track.keys[:n_blocks]
        used = sorted(set(self.sources.get(track.request.request_id, ())[:n_blocks]) or {0})
        try:
            for index in used:
                for part in self._part_keys(index, keys):
                    self.ledger.match(part, namespace=track.namespace)
        except Exception as e:  # the load itself reports what is missing
            log.warning("kvledger: TTL refresh failed (%s)", e)

    # --- outcomes --------------------------------------------------------------------

    def note_failed(self, invalid_block_ids: Iterable[int]) -> None:
        """The workers reported blocks whose load failed: vLLM recomputes them."""
        bad = set(invalid_block_ids)
        if not bad:
            return
        for track in self.tracks.values():
            failed = [i for i, bid in enumerate(track.load_ids) if bid in bad]
            if failed:
                track.failed_blocks += len(track.load_ids) - failed[0]
                track.loaded_tokens -= track.load_tokens - failed[0] * self.block
                track.load_ids = ()

    def note_failed_requests(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' (asynchronous) loads as failed: vLLM recomputes them from 0."""
        for req_id in req_ids:
            track = self.tracks.get(req_id)
            if track is not None and track.load_tokens:
                track.failed_blocks += max(len(track.load_ids), 1)
                track.loaded_tokens -= track.load_tokens
                track.load_ids, track.load_tokens, track.window_at = (), 0, 0

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """Forget a request; what the connector did for it (vLLM returns it as kv_transfer_params):
        a hybrid model's also says at which position its window came from a snapshot (`window_at`, 0: none)."""
        self.checked.pop(req_id, None)
        self.branches.pop(req_id, None)
        self.sources.pop(req_id, None)
        track = self.tracks.pop(req_id, None)
        if track is None:
            return None
        report = {"namespace": track.namespace, "loaded_tokens": track.loaded_tokens,
                  "failed_blocks": track.failed_blocks}
        if self.state is not None:
            report["window_at"] = track.window_at
        return {"kvledger": report}
