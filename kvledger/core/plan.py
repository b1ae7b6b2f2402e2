"""Capacity planner: bytes, storage per day, and whether a hit is worth its fetch.

Units: bytes, seconds, tokens; bandwidth in bytes/s; throughput in tokens/s.
The model is first order on purpose: prefill time is linear in tokens (attention's
quadratic part makes long prompts slower, so real hits pay off more than shown),
and a hit is charged its fetch time plus the computed suffix, with no overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvledger.core.hit import hit_cap
from kvledger.core.spec import PUBLISHED_PREFILL_SOURCE, PUBLISHED_PREFILL_TOKENS_PER_S, ModelSpec

DAY_S = 86_400
DEFAULT_TTL_DAYS = {"agent": 3.0, "chatbot": 7.0}   # the TTL classes' defaults everywhere (store.ttl: seconds)
MAX_PROMPT_TOKENS = 1 << 30        # one prompt (or its output): at most ~1.07 billion tokens
MAX_REQUESTS_PER_DAY = 1e12
MAX_TTL_DAYS = 36_500.0            # a century


def _check_finite(**values: float) -> None:
    """`ValueError` naming the first value that is nan or ±inf (every comparison with nan is False)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")


def check_tokens(name: str, n: object) -> int:
    """A token count: an int (not a bool) in [0, MAX_PROMPT_TOKENS]; `ValueError` naming the limit otherwise."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{name} must be an integer, got {n!r}")
    if not 0 <= n <= MAX_PROMPT_TOKENS:
        raise ValueError(f"{name} must lie in [0, {MAX_PROMPT_TOKENS:,}], got {n:,}")
    return n


@dataclass(frozen=True, slots=True)
class Traffic:
    """A day of traffic. `mix` maps TTL class → share of requests (shares sum to 1)."""

    requests_per_day: float = 100_000
    reuse: float = 0.56                  # share of prompt tokens served from cache (DESIGN.md: 56%)
    output_tokens: int = 0               # decode tokens per request, stored at request end (rule 7)
    mix: dict[str, float] = field(default_factory=lambda: {"agent": 0.5, "chatbot": 0.5})
    ttl_days: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TTL_DAYS))

    def __post_init__(self) -> None:
        _check_finite(requests_per_day=self.requests_per_day, reuse=self.reuse)
        _check_finite(**{f"mix share of {k}": v for k, v in self.mix.items()})
        _check_finite(**{f"TTL days of {k}": v for k, v in self.ttl_days.items()})
        check_tokens("output tokens", self.output_tokens)
        if not 0 <= self.requests_per_day <= MAX_REQUESTS_PER_DAY:
            raise ValueError(f"requests per day must lie in [0, {MAX_REQUESTS_PER_DAY:.0e}]")
        if any(v > MAX_TTL_DAYS for v in self.ttl_days.values()):
            raise ValueError(f"TTLs must be at most {MAX_TTL_DAYS:,.0f} days")
        if not 0 <= self.reuse <= 1:
            raise ValueError("reuse must lie in [0, 1]")
        if any(v < 0 for v in self.mix.values()) or not math.isclose(sum(self.mix.values()), 1.0, abs_tol=1e-6):
            raise ValueError("traffic mix shares must be >= 0 and sum to 1")
        missing = set(self.mix) - set(self.ttl_days)
        if missing:
            raise ValueError(f"no TTL for class(es): {', '.join(sorted(missing))}")
        if any(v <= 0 for v in self.ttl_days.values()):
            raise ValueError("TTLs must be > 0 days")


@dataclass(frozen=True, slots=True)
class Link:
    """How fast KV moves and how fast it is recomputed (`Link.of(spec)`: at the model's own prefill rate)."""

    fetch_bytes_per_s: float = 10e9      # assumed storage → host bandwidth of one prefill engine
    fetch_latency_s: float = 1e-3        # fixed cost of one fetch (metadata, first byte)
    prefill_tokens_per_s: float = PUBLISHED_PREFILL_TOKENS_PER_S

    def __post_init__(self) -> None:
        _check_finite(fetch_bytes_per_s=self.fetch_bytes_per_s, fetch_latency_s=self.fetch_latency_s,
                      prefill_tokens_per_s=self.prefill_tokens_per_s)
        if self.fetch_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0 or self.fetch_latency_s < 0:
            raise ValueError("bandwidth and throughput must be > 0, latency >= 0")

    @classmethod
    def of(cls, spec: ModelSpec, **kw: float) -> Link:
        """A link whose prefill rate is the model's (`ModelSpec.prefill_tokens_per_s`, or the published V4
        rate when the spec has none) unless `prefill_tokens_per_s` is given."""
        kw.setdefault("prefill_tokens_per_s", spec.prefill_tokens_per_s or PUBLISHED_PREFILL_TOKENS_PER_S)
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    model: str
    prompt_tokens: int
    block_size: int
    block_bytes: int
    blocks_per_prompt: int
    prompt_kv_bytes: int               # full blocks of one prompt
    hit_eligible_tokens: int           # the cap of rule 3
    reserve_tokens: int                # R of rule 3: the prompt's last R tokens are always computed
    has_swa: bool                      # False: no sliding-window layers, so no snapshot and no rings:
    swa_snapshot_bytes: int | None     #   these three are None
    inference_ring: int | None
    kvstore_ring: int | None
    bytes_written_per_day: int         # new full blocks stored per day, all classes
    storage_bytes_by_class: dict[str, int]
    storage_bytes: int                 # steady state: written per day × TTL, summed over classes
    fetch_s: float                     # fetching the eligible prefix
    prefill_s: float                   # computing the whole prompt (at link.prefill_tokens_per_s)
    prefill_source: str                # where that rate comes from (the model's, or "--prefill-tps")
    ttft_hit_s: float                  # fetch + computing the rest
    speedup: float                     # prefill_s / ttft_hit_s
    break_even_tokens: int | None      # shortest cached prefix (whole blocks) worth fetching; None: never
    traffic: Traffic
    link: Link


def plan(spec: ModelSpec, prompt_tokens: int, traffic: Traffic = Traffic(), link: Link | None = None,
         prefill_source: str | None = None) -> CapacityPlan:
    """The figures of one prompt length. `link` None: `Link.of(spec)` (the model's prefill rate);
    `prefill_source` says where a given link's rate comes from (default: the model's source)."""
    check_tokens("prompt tokens", prompt_tokens)
    link = link if link is not None else Link.of(spec)
    swa = spec.has_swa
    b = spec.block_size
    blocks = prompt_tokens // b
    cap = hit_cap(prompt_tokens, spec)
    # Each request stores the full blocks it did not hit, and its decode blocks.
    new_tokens = prompt_tokens * (1 - traffic.reuse) + traffic.output_tokens
    written = traffic.requests_per_day * (new_tokens // b) * spec.block_bytes()
    by_class = {c: int(written * share * traffic.ttl_days[c]) for c, share in traffic.mix.items()}
    fetch = link.fetch_latency_s + cap * spec.bytes_per_token() / link.fetch_bytes_per_s if cap else 0.0
    prefill = prompt_tokens / link.prefill_tokens_per_s
    ttft_hit = fetch + (prompt_tokens - cap) / link.prefill_tokens_per_s
    return CapacityPlan(
        model=spec.name,
        prompt_tokens=prompt_tokens,
        block_size=b,
        block_bytes=spec.block_bytes(),
        blocks_per_prompt=blocks,
        prompt_kv_bytes=blocks * spec.block_bytes(),
        hit_eligible_tokens=cap,
        reserve_tokens=spec.reserve_tokens,
        has_swa=swa,
        swa_snapshot_bytes=spec.state_size_to_disk() if swa else None,
        inference_ring=spec.inference_ring() if swa else None,
        kvstore_ring=spec.kvstore_ring() if swa else None,
        bytes_written_per_day=int(written),
        storage_bytes_by_class=by_class,
        storage_bytes=sum(by_class.values()),
        fetch_s=fetch,
        prefill_s=prefill,
        prefill_source=prefill_source or _prefill_source(spec, link),
        ttft_hit_s=ttft_hit,
        speedup=prefill / ttft_hit if ttft_hit > 0 else 1.0,
        break_even_tokens=break_even_tokens(spec, link),
        traffic=traffic,
        link=link,
    )


def _prefill_source(spec: ModelSpec, link: Link) -> str:
    """Where `link`'s prefill rate comes from, when the caller did not say."""
    if link.prefill_tokens_per_s == spec.prefill_tokens_per_s:
        return spec.prefill_source
    if link.prefill_tokens_per_s == PUBLISHED_PREFILL_TOKENS_PER_S:
        return PUBLISHED_PREFILL_SOURCE
    return "given"


def break_even_tokens(spec: ModelSpec, link: Link) -> int | None:
    """Smallest whole-block prefix P with fetch(P) < prefill(P), i.e.
    latency + P·bytes/bandwidth < P/throughput. None when fetching never pays."""
    per_token_gain = 1 / link.prefill_tokens_per_s - spec.bytes_per_token() / link.fetch_bytes_per_s
    if per_token_gain <= 0:
        return None
    p = link.fetch_latency_s / per_token_gain
    b = spec.block_size
    return max(math.floor(p / b) + 1, 1) * b
