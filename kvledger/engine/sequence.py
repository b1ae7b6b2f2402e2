"""One request inside the engine: its tokens, its device blocks and slot, where its KV stands.

Positions of a sequence of `len(tokens)` tokens (prompt + output so far):

    | range                          | meaning                                                      |
    |--------------------------------|--------------------------------------------------------------|
    | [0, cached_tokens)             | reused: device prefix cache, or fetched from the block ledger |
    | [recompute_from, computed)     | computed by this engine (recompute_from <= cached_tokens)    |
    | [computed, len(tokens))        | still to compute (the last token of a decoding sequence)     |
    | [0, high_water)                | computed at least once, by this or an earlier admission      |

Preemption by recompute (the scheduler's, LIFO) releases blocks and slot and puts the sequence back in
the waiting queue with its tokens, generator and usage; readmitted, it computes [resume point,
len(tokens)) as a prefill (`HitLoader`'s resume table) and decodes on. Positions below `high_water`
computed again are counted in `recomputed`, never in `prompt_forwarded`.

Invariants: computed <= len(tokens); len(block_table) * B >= computed, and >= len(tokens) for a RUNNING
sequence once the scheduler reserved its step (admission reserves the prompt + 1 token, or, without
preemption, prompt + max_tokens); the block table's first `device_hit_blocks` blocks came from the device
prefix cache and hold the blocks of `keys[:device_hit_blocks]` (on a first admission; a resume's own
device blocks are not counted there, its reuse is no prompt cache hit).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from kvledger.core import PUBLIC_NAMESPACE, HitDecision, tenant_of
from kvledger.engine.api import EngineRequest, SamplingParams


_UIDS = itertools.count()


def new_uid() -> int:
    """An id no other sequence or admission of this process has had (a decode mirror's key, `Chunk.seq`)."""
    return next(_UIDS)


class SequenceStatus(Enum):
    WAITING = auto()   # queued, nothing allocated
    LOADING = auto()   # blocks allocated, hit blocks being fetched into host shared memory
    RUNNING = auto()   # prefilling (chunked) or decoding
    FINISHED = auto()


@dataclass(slots=True)
class Sequence:
    request: EngineRequest
    tokens: list[int]
    prompt_len: int                        # the tokens given: the prompt, or for a later leg the prompt + output so far
    decision: HitDecision                  # the decision actually followed (may be lowered on a fault)
    keys: list[bytes]                      # chain keys of the full blocks known so far (prompt, then decode)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    device_hit_blocks: int = 0             # leading blocks taken from the device prefix cache
    computed: int = 0                      # positions whose KV is in the device caches
    cached_tokens: int = 0                 # prompt tokens reused (reported in usage)
    keep_blocks_until: int = 0             # replay: block KV below this is reused, not rewritten
    truncate_from: int | None = None
    stored_blocks: int = 0                 # leading blocks known to be on the block ledger
    fetch_job: object | None = None        # pending fetch (engine.fetcher.FetchJob)
    stream_stalled: bool = False           # its streamed forward waited too long once: it waits for the fetch now
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    fetch_bytes: int = 0                   # read by the fetcher for this sequence (RequestUsage.fetch_bytes)
    fetch_misses: dict[str, int] = field(default_factory=dict)   # cause → blocks the fetch missed
    finish_reason: str | None = None
    checkpoints: tuple[int, ...] = ()      # rule 4′: prefill positions a chunk ends at, to snapshot there
    block_size: int = 0                    # B (the engine sets it; 0: a resume chunk does not stop at the replica)
    prompt_forwarded: int = 0              # prompt positions run through the forward (computed_prompt_tokens),
                                           # each counted once: a resume's second pass counts in `recomputed`
    high_water: int = 0                    # positions [0, this) were computed at least once (0: no forward yet)
    recomputed: int = 0                    # positions below high_water computed again after a preemption
    preemptions: int = 0                   # times the scheduler preempted this sequence (RequestUsage.preemptions)
    handed_tail: bool = False              # the hit's last block is a tail handed over (P/D), not a ledger block
    uid: int = field(default_factory=new_uid)   # this admission's id: a preemption gives a new one (decode_mirror)
    stores: bool = True                    # what it computes may stay (blocks, snapshots, device cache, tail): the
                                           # request's `store`, turned off for good by a forget of its tenant

    def prefill_chunk(self, budget: int) -> int:
        """Tokens the next prefill chunk computes: the rest of [computed, len(tokens)) within `budget`, ending at
        the next stop, if any (mid-prefill, the window ring holds only the latest window). Stops: the
        checkpoints, and for a resume (len(tokens) > prompt_len) the prompt's end (rule 4's windows are taken
        there) and the last block boundary in the output (the decode replica is taken there)."""
        n = min(len(self.tokens) - self.computed, budget)
        stop = next((x for x in self._stops() if x > self.computed), None)
        return n if stop is None else min(n, stop - self.computed)

    def _stops(self) -> tuple[int, ...]:
        """Positions a prefill chunk ends at, ascending (`prefill_chunk`)."""
        if len(self.tokens) == self.prompt_len:
            return self.checkpoints
        b = self.block_size
        last_boundary = (len(self.tokens) - 1) // b * b if b else 0
        tail = (last_boundary,) if last_boundary > self.prompt_len else ()
        return (*self.checkpoints, self.prompt_len, *tail)

    @property
    def exact(self) -> bool:
        """Rule 9: no window of this sequence was truncated, so every block, window and replica it computes is
        what a cold prefill computes, and may be stored and shared. False from a truncation on, for good (unless
        a resume after a preemption, its reused blocks gone, recomputes it from 0: `HitLoader` resume table)."""
        return self.truncate_from is None

    def owner(self, block: int) -> str:
        """Whose block `block` of this sequence is, as a forget finds it (DESIGN rule 12): a published public
        prefix's blocks are the public namespace's, the others its request's tenant's (`core.tenant_of`)."""
        return PUBLIC_NAMESPACE if block < self.request.public_blocks else tenant_of(self.request.namespace)

    @property
    def keeps(self) -> bool:
        """Whether what this sequence computes may outlive it: exact (rule 9) and storing (rule 12's no-store and
        forget). Every write-back and the device prefix cache ask this, never `exact` or `stores` alone."""
        return self.exact and self.stores

    @classmethod
    def from_request(cls, req: EngineRequest) -> Sequence:
        tokens = [int(t) for t in req.tokens]
        return cls(req, tokens, len(tokens), req.decision, list(req.keys), stores=req.store)

    @property
    def request_prompt_len(self) -> int:
        """L of the request this sequence computes (a later leg's tokens go past it): what the model's per-request
        constants derive from (`Chunk.prompt_len`), and the hit rule's length (`decided_length`)."""
        return self.request.own_prompt_len

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def in_prefill(self) -> bool:
        """More than one token to compute (a prompt, or a resume catching up), or the prompt not done yet."""
        return self.computed < self.prompt_len or self.computed < len(self.tokens) - 1

    def add_time(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds
