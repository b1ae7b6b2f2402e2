"""What if: the cluster simulator (sim_core) on a server's own recorded trace, with other settings, beside what
the live server measured over the same window.

1. The window: the recorded requests (`whatif_trace.load_recorded`), their live figures (cached tokens, TTFT).
2. Calibration, from the recorded per-request timings (never assumed when the window measured it):
   - prefill tokens/s: the engine's marginal rate, 1 / the slope of TTFT against computed prompt tokens
     (prompt − cached) over the requests that found no other in flight (least squares; its intercept is the
     fixed cost of a request: HTTP, tokenizing, CHECK, a step). The simulator's engines compute at that
     rate. Too few such requests (< 5, or computed lengths spanning < 256 tokens): computed tokens per busy
     second of each engine, busy from a request's arrival to its first token (the union of those
     intervals; `replay_report.busy_prefill_rate`, the live replay's measure, which counts the fixed costs
     as work and so runs the simulated engines slower than the live ones batch);
   - fetch bytes/s: the block bytes of the cached tokens of requests that fetched, per second their fetcher
     took (`live.fetch_s`: store → host, the server's `kvledger_fetch_seconds`);
   - decode tokens/s: the median over requests of (output − 1) / (first → last token);
   - TTFT overhead: the median of live TTFT − simulated TTFT over the window as recorded (HTTP, tokenizing,
     CHECK, the engine's step granularity: what the simulator does not model), added to every row's TTFT.
3. The server as it ran ("as recorded"): its model, engine count (distinct engines in the window), store
   capacity (with the live store's eviction low watermark and unit, the segment one write adds), TTL classes
   (seconds), routing policy, one shared
   store (`match`), snapshots in host memory, and each engine's device pool (its prefix cache in front of
   the store, which serves what the store lost as long as it holds it: `server.json`'s `device_blocks`).
   Its prediction beside the live figures shows the model's error on this very window.
4. Each row changes one setting of that: the capacity, the TTL classes, the routing policy (the live router's
   four over the shared store, with at least 2 engines; and the simulator's per-engine local caches), the SWA
   strategy (models with sliding-window layers). Rates in [0, 1], times in seconds, sizes in bytes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvledger.bench.replay_client import ReplayOutcome
from kvledger.bench.replay_report import busy_prefill_rate
from kvledger.bench.sim_core import ENGINE_POLICIES, SimConfig, percentile, reuse_ceiling, simulate
from kvledger.bench.sim_sweep import SWA_ROWS
from kvledger.bench.trace import TraceRequest
from kvledger.bench.whatif_trace import Recorded, live_figures, ttl_seconds
from kvledger.core import ModelSpec
from kvledger.engine.defaults import DEFAULTS

LIVE_LOW_WATERMARK = 0.9        # the embedded store evicts down to this share of its capacity (LmdbStore's default)
ASSUMED_FETCH_BPS = 10e9        # only when nothing in the window was fetched from the store (said in the report)
ASSUMED_DECODE_TPS = 30.0
CAPACITY_SHARES = (0.5, 0.25, 0.125)   # default capacity rows: shares of the store's peak as recorded
TTL_SHARES = (0.5, 0.125, 0.03125)     # default TTL rows: shares of the window's span


@dataclass(frozen=True, slots=True)
class Calibration:
    """The rates the simulator runs at, each with where it came from. Units: tokens/s, bytes/s, seconds."""

    prefill_tokens_per_s: float
    prefill_source: str
    fetch_bytes_per_s: float
    fetch_source: str
    decode_tokens_per_s: float
    decode_source: str
    ttft_overhead_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s, "prefill_source": self.prefill_source,
                "fetch_bytes_per_s": self.fetch_bytes_per_s, "fetch_source": self.fetch_source,
                "decode_tokens_per_s": self.decode_tokens_per_s, "decode_source": self.decode_source,
                "ttft_overhead_s": self.ttft_overhead_s,
                "ttft_overhead_source": "median of live TTFT − simulated TTFT over the window, as recorded; added to "
                                        "every row's TTFT"}


@dataclass(frozen=True, slots=True)
class Change:
    """One what-if row: the setting it changes (`kind`: capacity, ttl, routing, swa; "as recorded" for none),
    how it reads (`setting`), and the simulator fields it replaces in the server's own config."""

    kind: str
    setting: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, base: SimConfig) -> SimConfig:
        return replace(base, **self.fields)


AS_RECORDED = Change("as recorded", "the server's own settings")


def calibrate(requests: Sequence[TraceRequest], spec: ModelSpec) -> Calibration:
    """The rates of the module docstring's step 2, from the requests' live figures (TTFT overhead: 0 here)."""
    live = [r for r in requests if r.live is not None and r.live.ttft_s is not None]
    outcomes = [ReplayOutcome(i, r.input_length, r.live.cached_tokens, engine=r.live.engine, ttft_s=r.live.ttft_s,
                              sent_at=r.arrival_s) for i, r in enumerate(live)]
    tps, _ = busy_prefill_rate(outcomes)
    fitted = marginal_prefill_rate(live)
    if fitted is not None:
        tps, tps_source = fitted[0], (f"recorded timings: 1 / slope of TTFT vs computed tokens over {fitted[2]} "
                                      f"requests alone in flight (intercept {fitted[1] * 1e3:.0f} ms)")
    elif tps is not None:
        tps_source = "recorded timings: computed prompt tokens per busy second of each engine (arrival → first token)"
    else:
        tps, tps_source = spec.prefill_tokens_per_s or 1000.0, "the model's preset (nothing computed in the window)"
    fetched = [r for r in live if r.live.fetch_s]
    fetch_s = sum(r.live.fetch_s for r in fetched)
    hit_bytes = sum(r.live.cached_tokens // spec.block_size * spec.block_bytes() for r in fetched)
    if fetch_s > 0 and hit_bytes > 0:
        fetch, fetch_source = hit_bytes / fetch_s, "recorded timings: block bytes of the cached tokens per fetch second"
    else:
        fetch, fetch_source = ASSUMED_FETCH_BPS, "assumed (nothing in the window was fetched from the store)"
    rates = [(r.output_length - 1) / r.live.decode_s for r in live if r.output_length > 1 and r.live.decode_s]
    if rates:
        decode, decode_source = statistics.median(rates), "recorded timings: median (output − 1) / decode seconds"
    else:
        decode, decode_source = ASSUMED_DECODE_TPS, "assumed (no request decoded more than one token)"
    return Calibration(tps, tps_source, fetch, fetch_source, decode, decode_source)


def marginal_prefill_rate(live: Sequence[TraceRequest]) -> tuple[float, float, int] | None:
    """(tokens/s, intercept s, requests used) of the least-squares line TTFT = a + computed / rate over the
    requests (sorted, with live TTFTs) that arrived while no earlier one was before its first token; None when
    fewer than 5, their computed lengths span under 256 tokens, or the slope is not positive."""
    alone, busy_until = [], -math.inf
    for r in live:
        if r.arrival_s >= busy_until:
            alone.append((r.input_length - r.live.cached_tokens, r.live.ttft_s))
        busy_until = max(busy_until, r.arrival_s + r.live.ttft_s)
    xs = [x for x, _ in alone]
    if len(alone) < 5 or max(xs) - min(xs) < 256:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in alone)
    slope = sum((x - mx) * (y - my) for x, y in alone) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        return None
    return 1.0 / slope, max(my - slope * mx, 0.0), len(alone)


def base_config(recorded: Recorded, spec: ModelSpec, cal: Calibration, decode_engines: int = 1) -> SimConfig:
    """The simulator's model of the server as it ran (the module docstring's step 3)."""
    server = recorded.server
    engines = max(len(live_figures(recorded.trace.requests)["engines"]), 1)
    capacity = server.get("store_capacity_bytes")
    policy = server.get("routing") if server.get("mode") == "cluster" else DEFAULTS.routing
    device = server.get("device_blocks")
    if not isinstance(device, int) or device < 1:   # a cluster's engines: their default pool
        context = server.get("max_model_len")
        floor = -(-context // spec.block_size) + 2 if isinstance(context, int) and context > 0 else 0
        device = max(DEFAULTS.kv_cache_bytes // spec.block_bytes(), floor)
    return SimConfig(spec=spec, prefill_engines=engines, decode_engines=decode_engines,
                     prefill_tps=cal.prefill_tokens_per_s, fetch_bytes_per_s=cal.fetch_bytes_per_s,
                     decode_tps=cal.decode_tokens_per_s,
                     capacity_bytes=float(capacity) if isinstance(capacity, (int, float)) else math.inf,
                     low_watermark=LIVE_LOW_WATERMARK, segments=True, ttl_s=ttl_seconds(server), routing="match",
                     engine_policy=policy if policy in ENGINE_POLICIES else DEFAULTS.routing,
                     replay=bool(server.get("replay", False)), device_blocks=device)


def default_changes(base: SimConfig, peak_bytes: int, span_s: float, capacities: Sequence[float] = (),
                    ttls: Sequence[Mapping[str, float]] = (), routings: Sequence[str] = (),
                    engines: int | None = None) -> list[Change]:
    """The rows: the given capacities (bytes), TTL tables (seconds per class) and routing policies, or by default
    shares of the recorded peak and span and every policy; then the SWA strategies (windowed models only)."""
    changes = [Change("capacity", _size(c), {"capacity_bytes": c})
               for c in (capacities or [*(peak_bytes * s for s in CAPACITY_SHARES if peak_bytes), math.inf])]
    default_ttls = [dict.fromkeys(base.ttl_s or ("agent", "chatbot"), span_s * s) for s in TTL_SHARES] if span_s else []
    changes += [Change("ttl", _ttl(t), {"ttl_s": dict(t)}) for t in (ttls or default_ttls)]
    n = engines or max(base.prefill_engines, 2)
    for policy in routings or ENGINE_POLICIES:
        changes.append(Change("routing", f"{policy}, {n} engines, shared store",
                              {"routing": "match", "engine_policy": policy, "prefill_engines": n}))
    if not routings:
        changes += [Change("routing", f"{local}, {n} engines, local caches",
                           {"routing": local, "engine_policy": "cache-aware", "prefill_engines": n})
                    for local in ("affinity", "random")]
    if base.spec.has_swa:
        changes += [Change("swa", label, {"swa": swa, "swa_period": period, "replay": replay})
                    for label, swa, period, replay in SWA_ROWS]
    return changes


def _size(capacity: float) -> str:
    return "unlimited" if math.isinf(capacity) else f"{capacity / 1e6:.4g} MB"


def _ttl(ttl: Mapping[str, float]) -> str:
    values = set(ttl.values())
    if len(values) == 1:
        return f"{values.pop():.4g} s, every class"
    return ", ".join(f"{k} {v:.4g} s" for k, v in sorted(ttl.items()))


def row(requests: Sequence[TraceRequest], cfg: SimConfig, change: Change, overhead_s: float) -> dict[str, Any]:
    """One simulator run's figures (TTFT with the overhead added; `ttft_s` per request, in arrival order)."""
    res = simulate(requests, change.apply(cfg))
    return {"change": change.kind, "setting": change.setting, "token_hit_rate": res.token_hit_rate,
            "block_hit_rate": res.block_hit_rate,
            "ttft_p50_s": percentile(res.ttft_s, 50) + overhead_s if res.ttft_s else None,
            "ttft_p99_s": percentile(res.ttft_s, 99) + overhead_s if res.ttft_s else None,
            "hit_kinds": {k: v for k, v in res.kinds.items() if v},
            "store_bytes_max": max((b for _, b in res.store_series), default=0),
            "evicted_bytes": res.evicted_bytes, "expired_bytes": res.expired_bytes, "ttft_s": res.ttft_s}


def whatif(recorded: Recorded, spec: ModelSpec, changes: Sequence[Change] | None = None, *,
           capacities: Sequence[float] = (), ttls: Sequence[Mapping[str, float]] = (), routings: Sequence[str] = (),
           engines: int | None = None, decode_engines: int = 1) -> dict[str, Any]:
    """The report: the live window, the calibration, the server as recorded, and one row per change (the given
    ones, or `default_changes` built from `capacities`, `ttls`, `routings`, `engines`)."""
    requests = recorded.trace.requests
    cal = calibrate(requests, spec)
    base = base_config(recorded, spec, cal, decode_engines)
    recorded_row = row(requests, base, AS_RECORDED, 0.0)
    live = live_figures(requests)
    residual = [r.live.ttft_s - s for r, s in zip(requests, recorded_row["ttft_s"])
                if r.live is not None and r.live.ttft_s is not None]
    overhead = max(statistics.median(residual), 0.0) if residual else 0.0
    cal = replace(cal, ttft_overhead_s=overhead)
    recorded_row = row(requests, base, AS_RECORDED, overhead)
    unlimited = row(requests, replace(base, capacity_bytes=math.inf, ttl_s=None), AS_RECORDED, 0.0)
    if changes is None:
        changes = default_changes(base, unlimited["store_bytes_max"], live["span_s"], capacities, ttls, routings,
                                  engines)
    rows = [row(requests, base, c, overhead) for c in changes]
    for r in (recorded_row, *rows):
        r["token_hit_rate_change"] = r["token_hit_rate"] - recorded_row["token_hit_rate"]
        r.pop("ttft_s")
    return {"source": recorded.trace.source, "requests": len(requests), "window_start_epoch_s": recorded.start_epoch_s,
            "span_s": live["span_s"], "reuse_ceiling": reuse_ceiling(requests), "warnings": list(recorded.warnings),
            "live": live, "as_recorded": recorded_row, "model_error": {
                "token_hit_rate": recorded_row["token_hit_rate"] - live["token_hit_rate"],
                "note": "as recorded (the simulator) − live, over the same window"},
            "calibration": cal.to_json(), "server": recorded.server, "assumptions": _assumptions(base), "rows": rows}


def _assumptions(base: SimConfig) -> dict[str, Any]:
    return {"model": base.spec.name, "prefill_engines": base.prefill_engines, "decode_engines": base.decode_engines,
            "capacity_bytes": None if math.isinf(base.capacity_bytes) else base.capacity_bytes,
            "low_watermark": base.low_watermark, "ttl_s": base.ttl_s, "routing": base.routing,
            "engine_policy": base.engine_policy, "swa": base.swa, "state_slots": base.state_slots,
            "replay": base.replay, "device_blocks_per_engine": base.device_blocks,
            "service_model": "FIFO per prefill engine; fetch then compute; compute linear in tokens (sim_core)"}
