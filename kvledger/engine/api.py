"""The engine's API records: what the server and the entrypoint hand the engine and
what it hands back. Plain records, no torch here, so the entrypoint can import them cheaply.

Units: tokens are vocabulary ids; positions and lengths are in tokens; times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvledger.core import KEY_BYTES, HitDecision, ModelSpec, chain_parent, extend_chain

# "handoff": continued elsewhere (cluster mode); "error": this request failed in the engine, the others went on
FINISH_REASONS = ("stop", "length", "abort", "handoff", "error")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is drawn. temperature 0 → greedy (argmax), deterministic."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                        # 0 → off
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One prompt, its chain keys (one per full block, `core.chain_keys`) and the CHECK's decision.

    A later leg of a cluster request continues it: `tokens` are the request's prompt and the output so far, and
    `prompt_len` says where the prompt ends. Every per-request constant of the model's computation (tiny-v4's YoCo
    anchor L − 134) and the hit rule's length (`core.decided_length`) come from that prompt, never from the leg's
    tokens (rule 10). Invariant: 0 <= prompt_len <= len(tokens)."""

    request_id: str
    tokens: Any                  # tuple[int, ...] | np.ndarray: the prompt's token ids
    keys: list[bytes]
    decision: HitDecision
    sampling: SamplingParams
    namespace: str = "default"
    ttl_class: str | None = None
    keep_tail: bool = False      # a P/D prefill leg: keep the prompt's partial last block for the decode engine
    tail_kv: bytes | None = None  # a P/D decode leg: that block, handed over (`core.with_tail` raised the decision)
    prompt_len: int = 0          # the request's own prompt length, when `tokens` continue it; 0: all of `tokens`
    public_blocks: int = 0       # leading whole blocks that are a published public prefix (`core.chain_parent`)
    store: bool = True           # False (no-store, DESIGN rule 12): nothing it computes stays once it ends (no
                                 # block, snapshot, device cache entry or tail); it may still read what is cached
    snapshot_at: tuple[int, ...] = ()   # rule 4″: block boundaries where the prefill also snapshots, other
                                 # prompts likely sharing the prefix up to there (`core.shared_prefix_positions`)

    def __post_init__(self) -> None:
        if not 0 <= self.prompt_len <= len(self.tokens):
            raise ValueError(f"prompt_len {self.prompt_len} must be in [0, {len(self.tokens)}] (the tokens given)")
        if not 0 <= self.public_blocks <= len(self.keys):
            raise ValueError(f"public_blocks {self.public_blocks} must be in [0, {len(self.keys)}] (the prompt's "
                             "whole blocks)")

    @property
    def own_prompt_len(self) -> int:
        """L of the request this leg is part of: `prompt_len`, or every token when it is 0."""
        return self.prompt_len or len(self.tokens)


def check_request_keys(req: EngineRequest, tokens: np.ndarray, spec: ModelSpec) -> None:
    """`ValueError` unless `req.keys` can be the chain keys of `tokens`: one 16-byte key per full block, and
    the first one that of this model's and this namespace's root over the first block (after a public prefix, the
    first block's under the public root and the first private block's under the namespace). The keys come from
    the CHECK that made the decision (the entrypoint's, once; in the cluster mode over an authenticated
    session), so the engine hashes one block of them, not the prompt: a key list made for another
    namespace or model is refused, the rest is the CHECK's."""
    b = spec.block_size
    if len(req.keys) != tokens.size // b or any(len(k) != KEY_BYTES for k in req.keys):
        raise ValueError(f"keys: one {KEY_BYTES}-byte core.chain_keys key per full block of the prompt")
    for first in sorted({0, req.public_blocks} & set(range(len(req.keys)))):   # the root's block, the first private
        parent = chain_parent(spec, req.namespace, req.keys[:first], public_blocks=req.public_blocks)
        if req.keys[first] != extend_chain(parent, tokens[first * b:(first + 1) * b].astype(np.uint32), b)[0]:
            raise ValueError(f"keys are not this prompt's core.chain_keys in this namespace (block {first} differs)")


@dataclass(frozen=True, slots=True)
class Leg:
    """One engine leg of a cluster request (entrypoint/remote.py): which engine ran it, as what, and from
    which output token on (the leg computed prompt + output[:start] and generated after it)."""

    kind: str      # "whole" | "prefill" | "decode" | "continue"
    engine: str
    start: int     # output tokens the client had when the leg began
    cached_tokens: int | None = None           # of the leg's tokens (prompt + output[:start]), those it reused,
    computed_prompt_tokens: int | None = None  # and those it ran through the model (None: it never reported)


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """Token counts and timings of one request.

    `cached_tokens` are the prompt tokens actually reused: below `decision.hit_tokens` when a block
    or snapshot failed to load (rule 8: recompute, reported honestly)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_kind: str                # HitKind value actually used ("snapshot", "fallback", "replay", "full", "miss")
    ttft_s: float | None         # admission → first token
    timings: dict[str, float] = field(default_factory=dict)  # check_s, fetch_s, swapin_s, compute_s, ...
    device_cached_tokens: int = 0  # of cached_tokens, those found in the engine's own device prefix cache
                                   # (the rest came from the ledgers)
    engine: str | None = None      # the engine that served the prompt (cluster mode; None in one process)
    fetch_bytes: int = 0           # bytes the fetcher really read from the block ledger for this prompt
                                   # (0 for a device-cache hit: no estimate from cached tokens)
    fetch_misses: dict[str, int] = field(default_factory=dict)  # blocks the fetch missed, by cause
                                   # ("absent", "corrupt"), as the fetcher process's store counted them
    computed_prompt_tokens: int = 0  # prompt positions this engine ran through the forward, counted there (not
                                   # derived from the decision): cached + computed = prompt for an exact hit,
                                   # so a usage that claims more reuse than happened shows
    legs: tuple[Leg, ...] = ()     # the cluster's engine legs of the request, in order (empty in one process)
    preemptions: int = 0           # times the engine preempted it (recompute); its answer is the unpreempted one
    recomputed_tokens: int = 0     # positions computed again after preemptions (never in computed_prompt_tokens)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What `Engine.step()` yields: one per request per step that produced tokens or ended it."""

    request_id: str
    token_ids: tuple[int, ...]   # tokens produced in this step (usually 1; 0 on an error end or abort)
    finished: bool
    finish_reason: str | None    # one of FINISH_REASONS, or None while it runs
    usage: RequestUsage | None = None  # on the first event (prompt) and the last (totals)
