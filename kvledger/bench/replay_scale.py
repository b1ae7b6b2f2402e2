"""Scaling a trace down to what a 2-core CPU serves: lengths in whole 128-token blocks, a context
cap, fewer requests, compressed arrival times. The simulator runs on exactly these scaled requests.

Lengths. A request names its prompt by content ids of `bt`-token blocks (512 in Mooncake traces,
128 in the generated workloads), chained: equal ids at position i ⇒ equal prompts up to the end
of block i. Scaling keeps every k-th id and turns each kept id into u whole 128-token blocks whose
tokens are a pure function of (id, j):

    factor = u · 128 / (k · bt)       k = round(128 / (bt · S)), u = 1    when bt · S < 128
                                      k = 1, u = round(bt · S / 128)       otherwise
    kept ids: positions i ≡ k − 1 (mod k) among the full ids, in order

So two prompts that share their first j ids share exactly their first u · ⌊j / k⌋ scaled blocks,
and no more (after the first differing id every id differs, hence every scaled block): a shared
prefix stays shared, a divergence stays a divergence. The prompt's partial tail (r < bt tokens,
or tokens past the last known id) becomes ⌈r · factor⌉ unique tokens, never a whole block. A
prompt longer than `max_prompt_tokens` keeps its first ⌊cap / 128⌋ blocks (a prefix: sharing
is kept). `max_tokens` = clamp(round(output_length · factor), 1, max_tokens_cap).

Rate. The first `max_requests` requests by arrival; arrival times are shifted to start at 0 and
multiplied by `time_factor` (by default the factor that fits the selection into `duration_s`,
never above 1).

The scaled requests carry no output block ids: the live replay sends every prompt as the trace
spells it, and the model's reply is not the trace's reply, so a next turn can reuse only the
blocks of earlier prompts — which is what the simulator is given.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np

from kvledger.bench.trace import TraceRequest, Trace
from kvledger.bench.workloads import VOCAB

BLOCK = 128  # kvledger's block (every preset's block_size)


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a trace is scaled. Units: tokens, seconds; `time_factor` multiplies arrival times."""

    length_scale: float            # the asked factor S on lengths
    block_stride: int              # k: one id of every k kept
    blocks_per_id: int             # u: 128-token blocks per kept id
    source_block_tokens: int       # bt of the source
    max_prompt_tokens: int         # a multiple of 128
    max_tokens_cap: int
    max_requests: int
    time_factor: float

    def __post_init__(self) -> None:
        assert self.block_stride >= 1 and self.blocks_per_id >= 1 and self.source_block_tokens > 0
        assert self.max_prompt_tokens >= BLOCK and self.max_prompt_tokens % BLOCK == 0
        assert self.max_tokens_cap >= 1 and self.max_requests >= 1 and self.time_factor > 0

    @property
    def factor(self) -> float:
        """The realized length factor: scaled tokens per source token."""
        return self.blocks_per_id * BLOCK / (self.block_stride * self.source_block_tokens)

    def describe(self) -> dict:
        return {"length_scale_asked": self.length_scale, "length_factor": self.factor,
                "source_block_tokens": self.source_block_tokens, "block_stride": self.block_stride,
                "blocks_per_kept_id": self.blocks_per_id, "max_prompt_tokens": self.max_prompt_tokens,
                "max_tokens_cap": self.max_tokens_cap, "max_requests": self.max_requests,
                "time_factor": self.time_factor,
                "rule": "keep ids at positions i ≡ k−1 (mod k), each → u whole 128-token blocks; partial tail "
                        "→ ⌈r·factor⌉ unique tokens; prompt capped at max_prompt_tokens (a prefix); "
                        "max_tokens = clamp(round(output_length·factor), 1, cap); arrival = (t − t0)·time_factor"}


def make_scaling(trace: Trace, length_scale: float, max_prompt_tokens: int, max_tokens_cap: int,
                 max_requests: int, duration_s: float | None, time_factor: float | None) -> Scaling:
    """The Scaling for `trace` (its block size must be one for all its requests)."""
    assert length_scale > 0
    sizes = {r.block_tokens for r in trace.requests}
    if len(sizes) != 1:
        raise ValueError(f"the requests mix block sizes {sorted(sizes)}; a replay needs one")
    bt = sizes.pop()
    if bt * length_scale < BLOCK:
        stride, per_id = max(round(BLOCK / (bt * length_scale)), 1), 1
    else:
        stride, per_id = 1, max(round(bt * length_scale / BLOCK), 1)
    chosen = trace.requests[:max_requests]
    span = chosen[-1].arrival_s - chosen[0].arrival_s
    if time_factor is None:
        time_factor = 1.0 if duration_s is None or span <= duration_s else duration_s / span
    return Scaling(length_scale, stride, per_id, bt, max_prompt_tokens // BLOCK * BLOCK, max_tokens_cap,
                   max_requests, time_factor)


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """One request as the replay sends it (`tokens`, `max_tokens` at `arrival_s`) and as the
    simulator sees it (`sim`: 128-token ids, same arrival, no output ids)."""

    index: int
    arrival_s: float
    tokens: np.ndarray        # uint32 token ids
    max_tokens: int
    sim: TraceRequest


def _sub_id(h: int, j: int, u: int) -> int:
    if u == 1:
        return h
    digest = hashlib.blake2b(struct.pack("<qq", h & (2**63 - 1), j), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def block_tokens_of(block_id: int, n: int = BLOCK) -> np.ndarray:
    """The tokens of a scaled block (or tail) named `block_id`: a pure function of the id."""
    return np.random.default_rng([block_id & (2**63 - 1), 0x5CA1E]).integers(0, VOCAB, n, dtype=np.uint32)


def scale_request(r: TraceRequest, index: int, s: Scaling, t0: float) -> ScaledRequest:
    """Scale one request (see the module docstring); `t0` is the first selected arrival."""
    bt, k, u = r.block_tokens, s.block_stride, s.blocks_per_id
    full = min(len(r.hash_ids), r.input_length // bt)
    ids = [_sub_id(r.hash_ids[i], j, u) for i in range(k - 1, full, k) for j in range(u)]
    rest = r.input_length - full * bt
    tail = math.ceil(rest * s.factor) if rest else 0
    cap_blocks = s.max_prompt_tokens // BLOCK
    if len(ids) > cap_blocks or (len(ids) == cap_blocks and tail):
        ids, tail = ids[:cap_blocks], 0
    if not ids and not tail:
        tail = 1  # every request sends at least one token
    tail = min(tail, BLOCK - 1)
    # the tail is unique to this request unless the trace names it (then equal ids → equal tails)
    tail_id = r.hash_ids[full] if full < len(r.hash_ids) else -(index + 1)
    parts = [block_tokens_of(h) for h in ids]
    if tail:
        parts.append(block_tokens_of(tail_id ^ (0x7A11 << 48), tail))
    tokens = np.concatenate(parts)
    length = len(ids) * BLOCK + tail
    assert tokens.size == length
    sim_ids = tuple(ids) + ((tail_id ^ (0x7A11 << 48),) if tail else ())
    max_tokens = min(max(round(r.output_length * s.factor), 1), s.max_tokens_cap)
    arrival = (r.arrival_s - t0) * s.time_factor
    sim = TraceRequest(arrival, length, max_tokens, sim_ids, BLOCK, (), r.ttl_class, r.session)
    return ScaledRequest(index, arrival, tokens, max_tokens, sim)


def scale_trace(trace: Trace, s: Scaling) -> list[ScaledRequest]:
    chosen = trace.requests[: s.max_requests]
    t0 = chosen[0].arrival_s
    return [scale_request(r, i, s, t0) for i, r in enumerate(chosen)]
