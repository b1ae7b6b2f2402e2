"""The entrypoint ↔ engine messages of the cluster mode: JSON over HTTP, never pickle.

    POST /engine/v1/generate   body: GenerateBody            → NDJSON stream of WireEvent lines
    GET  /engine/v1/health     → {"status": ok/unhealthy/down, "engine", "role", "fault", "running"}

A stream is one `WireEvent` per line; an empty line is a keepalive (sent every
`KEEPALIVE_S` while the engine computes), so a reader's timeout tells a hung engine from a
long prefill. The last line has `finished: true`; a stream that ends without one broke (the
engine died) and the entrypoint continues the request elsewhere.

The engine recomputes the chain keys from the tokens and the namespace and the decision from
the entrypoint's CHECK figures (`cached_blocks`, `snapshots`): `core.decide_hit` is pure, so
both sides agree, and a body cannot make the engine read another tenant's blocks.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvledger.core import ModelSpec, chain_keys, decide_hit
from kvledger.core.hit import HitKind
from kvledger.engine.api import FINISH_REASONS, EngineRequest, RequestUsage, SamplingParams, TokenEvent

KEEPALIVE_S = 1.0
TOKEN_HEADER = "authorization"   # "Bearer <cluster token>"


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


class GenerateBody(BaseModel):
    """One leg of a request on one engine: the whole request, its prefill only (`max_tokens` 1), or
    the decode of a prefilled or handed-off request (tokens = prompt + output so far)."""

    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[str, Field(min_length=1, max_length=128)]
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    namespace: str = "default"
    ttl_class: str | None = None
    cached_blocks: Annotated[int, Field(ge=0)] = 0       # the CHECK: leading blocks the index holds
    snapshots: list[int] = []                            # the CHECK: snapshot positions found (at L1)
    replay: bool = False
    sampling: WireSampling
    wait_stored: bool = False    # hold the last event until this engine's writes are on the ledgers

    def engine_request(self, spec: ModelSpec) -> EngineRequest:
        tokens = np.asarray(self.tokens, dtype=np.uint32)
        keys = chain_keys(tokens, spec, self.namespace)
        decision = decide_hit(len(tokens), self.cached_blocks, set(self.snapshots), spec, replay=self.replay)
        return EngineRequest(self.request_id, tokens, keys, decision, self.sampling.params(), self.namespace,
                             self.ttl_class)


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
                     "fetch_bytes": u.fetch_bytes, "fetch_misses": u.fetch_misses}
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
                                 {str(k): int(v) for k, v in (u.get("fetch_misses") or {}).items()})
            _check_usage(usage)
        return TokenEvent(request_id, tuple(self.token_ids), self.finished, self.finish_reason, usage)

    def line(self) -> bytes:
        return self.model_dump_json(exclude_defaults=True).encode() + b"\n"


def _check_usage(u: RequestUsage) -> None:
    counts = (u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.device_cached_tokens, u.fetch_bytes,
              *u.fetch_misses.values())
    if min(counts) < 0 or not u.device_cached_tokens <= u.cached_tokens <= u.prompt_tokens:
        raise ValueError("impossible token counts in the usage")
    if u.hit_kind not in set(HitKind):
        raise ValueError(f"hit_kind {u.hit_kind!r}")
    if u.ttft_s is not None and not (isinstance(u.ttft_s, (int, float)) and 0 <= u.ttft_s < math.inf):
        raise ValueError("ttft_s must be a finite number >= 0")
