"""The entrypoint ↔ engine messages of the cluster mode: JSON over HTTP, never pickle.

    POST /engine/v1/generate   body: GenerateBody            → NDJSON stream of WireEvent lines
    POST /engine/v1/forget     body: ForgetBody              → {what it dropped: count} (`Engine.forget`)
    GET  /engine/v1/health     → {"status": ok/unhealthy/down, "engine", "role", "fault", "running"}
    GET  /engine/v1/tail/{key} → a P/D tail's KV (one block, octets), its reply MACed; 404 when not held

A stream is one `WireEvent` per line; an empty line is a keepalive (sent every
`KEEPALIVE_S` while the engine computes), so a reader's timeout tells a hung engine from a
long prefill. The last line has `finished: true`; a stream that ends without one broke (the
engine died) and the entrypoint continues the request elsewhere.

The chain keys and the hit decision are the entrypoint's (its CHECK computed them, once) and
travel with the tokens. `GenerateBody.engine_request` checks them once, as the leg enters the engine
process, without hashing the prompt again: one 16-byte key per full block, the first one this
namespace's (one block hashed: `api.check_request_keys`), and a decision `core.decide_hit` can
make for this prompt (`core.check_decision`, O(1)). It can
trust the keys because every body is authenticated (engine/session.py: a MAC under a key derived
from the cluster token), so only an entrypoint of this cluster can name which blocks a leg reads.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvledger.core import KEY_BYTES, HitDecision, ModelSpec, check_decision, decided_length
from kvledger.core.hit import HitKind
from kvledger.engine.api import (FINISH_REASONS, EngineRequest, RequestUsage, SamplingParams, TokenEvent,
                                 check_request_keys)

KEEPALIVE_S = 1.0
FORGET_PATH = "/engine/v1/forget"


class WireSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: Annotated[int, Field(ge=1)]
    temperature: Annotated[float, Field(ge=0)] = 0.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None

    @classmethod
    def of(cls, sp: SamplingParams) -> WireSampling:
        return cls(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                   repetition_penalty=sp.repetition_penalty, stop_token_ids=list(sp.stop_token_ids),
                   ignore_eos=sp.ignore_eos, seed=sp.seed)

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, repetition_penalty=self.repetition_penalty,
                              stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos, seed=self.seed)


class WireDecision(BaseModel):
    """`core.HitDecision` as JSON."""

    model_config = ConfigDict(extra="forbid")

    kind: HitKind
    hit_tokens: Annotated[int, Field(ge=0)]
    block_hit_tokens: Annotated[int, Field(ge=0)]
    swa_hit: bool
    recompute_from: Annotated[int, Field(ge=0)]
    truncate_from: Annotated[int, Field(gt=0)] | None
    cap: Annotated[int, Field(ge=0)]

    @classmethod
    def of(cls, d: HitDecision) -> WireDecision:
        return cls(kind=d.kind, hit_tokens=d.hit_tokens, block_hit_tokens=d.block_hit_tokens, swa_hit=d.swa_hit,
                   recompute_from=d.recompute_from, truncate_from=d.truncate_from, cap=d.cap)

    def decision(self) -> HitDecision:
        return HitDecision(self.kind, self.hit_tokens, self.block_hit_tokens, self.swa_hit, self.recompute_from,
                           self.truncate_from, self.cap)


HexKey = Annotated[str, Field(pattern=f"^[0-9a-f]{{{2 * KEY_BYTES}}}$")]


class GenerateBody(BaseModel):
    """One leg of a request on one engine: the whole request, its prefill only (`max_tokens` 1), or
    the decode of a prefilled or handed-off request (tokens = prompt + output so far)."""

    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[str, Field(min_length=1, max_length=128)]
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    keys: list[HexKey]           # the chain keys of `tokens`' full blocks (the entrypoint's CHECK)
    decision: WireDecision       # the CHECK's decision for `tokens`
    namespace: str = "default"
    ttl_class: str | None = None
    sampling: WireSampling
    wait_stored: bool = False    # hold the last event until this engine's writes are on the ledgers
    keep_tail: bool = False      # a P/D prefill leg: keep the prompt's partial last block (engine/tails.py)
    tail_from: Annotated[str, Field(pattern=r"^https?://[^\s]{1,200}$")] | None = None   # a P/D decode leg:
                                 # the URL of the engine that kept the tail of `tokens` but the last
    prompt_len: Annotated[int, Field(ge=0)] = 0   # the request's own prompt, when `tokens` continue it (api.py)
    public_blocks: Annotated[int, Field(ge=0)] = 0   # leading blocks of a published public prefix (api.py)
    store: bool = True           # False: a no-store request (api.py), nothing of it stays on the engine
    snapshot_at: Annotated[list[Annotated[int, Field(gt=0)]], Field(max_length=64)] = []   # rule 4″ (api.py)

    @classmethod
    def of(cls, req: EngineRequest, *, wait_stored: bool = False, tail_from: str | None = None) -> GenerateBody:
        return cls(request_id=req.request_id, tokens=[int(t) for t in req.tokens], keys=[k.hex() for k in req.keys],
                   decision=WireDecision.of(req.decision), namespace=req.namespace, ttl_class=req.ttl_class,
                   sampling=WireSampling.of(req.sampling), wait_stored=wait_stored, keep_tail=req.keep_tail,
                   tail_from=tail_from, prompt_len=req.prompt_len, public_blocks=req.public_blocks, store=req.store,
                   snapshot_at=list(req.snapshot_at))

    def engine_request(self, spec: ModelSpec, *, vocab_size: int, max_model_len: int) -> EngineRequest:
        """The request this body names, checked: the one check of a leg, where it enters the engine process (an
        in-process caller, the embedded server's `entrypoint.prepare`, made the keys and decision itself, so the
        engine takes its `EngineRequest` as it is). `ValueError` when a token lies outside `[0, vocab_size)`,
        the tokens do not fit a context of `max_model_len`, or the keys or decision cannot be this prompt's."""
        if max(self.tokens) >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        if len(self.tokens) >= max_model_len:
            raise ValueError(f"{len(self.tokens)} tokens do not fit the context of {max_model_len}")
        if any(x % spec.block_size for x in self.snapshot_at):
            raise ValueError(f"snapshot_at: block boundaries only (multiples of {spec.block_size})")
        tokens = np.asarray(self.tokens, dtype=np.uint32)
        req = EngineRequest(self.request_id, tokens, [bytes.fromhex(k) for k in self.keys], self.decision.decision(),
                            self.sampling.params(), self.namespace, self.ttl_class, keep_tail=self.keep_tail,
                            prompt_len=self.prompt_len, public_blocks=self.public_blocks, store=self.store,
                            snapshot_at=tuple(self.snapshot_at))
        check_request_keys(req, tokens, spec)
        check_decision(req.decision, decided_length(tokens.size, req.own_prompt_len, spec), spec)
        return req


class ForgetBody(BaseModel):
    """Forget a tenant on this engine (DESIGN rule 12): `tenant` is its namespace, salts apart (`core.tenant_of`)."""

    model_config = ConfigDict(extra="forbid")

    tenant: Annotated[str, Field(min_length=1, max_length=1024)]


class WireEvent(BaseModel):
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None    # RequestUsage's fields
    error: str | None = None               # "rejected: ..." (a client error) or "failed: ..." (the engine's)

    @classmethod
    def of(cls, ev: TokenEvent, engine_id: str) -> WireEvent:
        usage = None
        if ev.usage is not None:
            u = ev.usage
            usage = {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                     "completion_tokens": u.completion_tokens, "hit_kind": u.hit_kind, "ttft_s": u.ttft_s,
                     "timings": u.timings, "device_cached_tokens": u.device_cached_tokens, "engine": engine_id,
                     "fetch_bytes": u.fetch_bytes, "fetch_misses": u.fetch_misses,
                     "computed_prompt_tokens": u.computed_prompt_tokens, "preemptions": u.preemptions,
                     "recomputed_tokens": u.recomputed_tokens}
        return cls(token_ids=list(ev.token_ids), finished=ev.finished, finish_reason=ev.finish_reason, usage=usage)

    def token_event(self, request_id: str, vocab_size: int | None = None) -> TokenEvent:
        """The event as the engine meant it; ValueError for one no engine of ours sends: a token outside the
        vocabulary, a negative or impossible count, an unknown kind (the caller treats the leg as broken)."""
        if vocab_size is not None and not all(0 <= t < vocab_size for t in self.token_ids):
            raise ValueError("a token id outside the vocabulary")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r}")
        usage = None
        if self.usage is not None:
            u = self.usage
            usage = RequestUsage(int(u["prompt_tokens"]), int(u["cached_tokens"]), int(u["completion_tokens"]),
                                 str(u["hit_kind"]), u.get("ttft_s"), dict(u.get("timings") or {}),
                                 int(u.get("device_cached_tokens", 0)), u.get("engine"),
                                 int(u.get("fetch_bytes", 0)),
                                 {str(k): int(v) for k, v in (u.get("fetch_misses") or {}).items()},
                                 int(u.get("computed_prompt_tokens", 0)),
                                 preemptions=int(u.get("preemptions", 0)),
                                 recomputed_tokens=int(u.get("recomputed_tokens", 0)))
            _check_usage(usage)
        return TokenEvent(request_id, tuple(self.token_ids), self.finished, self.finish_reason, usage)

    def line(self) -> bytes:
        return self.model_dump_json(exclude_defaults=True).encode() + b"\n"


def _check_usage(u: RequestUsage) -> None:
    counts = (u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.device_cached_tokens, u.fetch_bytes,
              u.computed_prompt_tokens, u.preemptions, u.recomputed_tokens, *u.fetch_misses.values())
    if (min(counts) < 0 or not u.device_cached_tokens <= u.cached_tokens <= u.prompt_tokens
            or u.computed_prompt_tokens > u.prompt_tokens):
        raise ValueError("impossible token counts in the usage")
    if u.hit_kind not in set(HitKind):
        raise ValueError(f"hit_kind {u.hit_kind!r}")
    if u.ttft_s is not None and not (isinstance(u.ttft_s, (int, float)) and 0 <= u.ttft_s < math.inf):
        raise ValueError("ttft_s must be a finite number >= 0")
