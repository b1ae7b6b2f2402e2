"""One request inside the engine: its tokens, its device blocks and slot, where its KV stands.

Positions of a sequence of `len(tokens)` tokens (prompt + output so far):

    | range                          | meaning                                                      |
    |--------------------------------|--------------------------------------------------------------|
    | [0, cached_tokens)             | reused: device prefix cache, or fetched from the block ledger |
    | [recompute_from, computed)     | computed by this engine (recompute_from <= cached_tokens)    |
    | [computed, len(tokens))        | still to compute (the last token of a decoding sequence)     |

Invariants: computed <= len(tokens); len(block_table) * B >= computed (blocks for prompt +
max_tokens are reserved at admission); the block table's first `device_hit_blocks` blocks came
from the device prefix cache and hold the blocks of `keys[:device_hit_blocks]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from kvledger.core import HitDecision
from kvledger.engine.api import EngineRequest, SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()   # queued, nothing allocated
    LOADING = auto()   # blocks allocated, hit blocks being fetched into host shared memory
    RUNNING = auto()   # prefilling (chunked) or decoding
    FINISHED = auto()


@dataclass(slots=True)
class Sequence:
    request: EngineRequest
    tokens: list[int]
    prompt_len: int
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
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    fetch_bytes: int = 0                   # read by the fetcher for this sequence (RequestUsage.fetch_bytes)
    fetch_misses: dict[str, int] = field(default_factory=dict)   # cause → blocks the fetch missed
    finish_reason: str | None = None
    checkpoints: tuple[int, ...] = ()      # rule 4′: prefill positions a chunk ends at, to snapshot there
    prompt_forwarded: int = 0              # prompt positions run through the forward (computed_prompt_tokens)
    handed_tail: bool = False              # the hit's last block is a tail handed over (P/D), not a ledger block

    def prefill_chunk(self, budget: int) -> int:
        """Prompt tokens the next prefill chunk computes: the rest of the prompt within `budget`, ending at the
        next checkpoint, if any (mid-prefill, the window ring holds only the latest window)."""
        n = min(self.prompt_len - self.computed, budget)
        stop = next((x for x in self.checkpoints if x > self.computed), None)
        return n if stop is None else min(n, stop - self.computed)

    @property
    def exact(self) -> bool:
        """Rule 9: no window of this sequence was truncated, so every block, window and replica it computes is
        what a cold prefill computes, and may be stored and shared. False from a truncation on, for good."""
        return self.truncate_from is None

    @classmethod
    def from_request(cls, req: EngineRequest) -> Sequence:
        tokens = [int(t) for t in req.tokens]
        return cls(req, tokens, len(tokens), req.decision, list(req.keys))

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
        return self.computed < self.prompt_len

    def add_time(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds
