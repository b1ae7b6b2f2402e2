"""The figures of one replay run, and the simulator's prediction for the same scaled requests.

Live figures come from the responses alone: `token_hit_rate` = Σ cached prompt tokens / Σ prompt
tokens (`usage.prompt_tokens_details.cached_tokens`); a request is warm when it had cached tokens,
cold when it had none; the hit tokens split by where they came from (`usage.kvledger`: the
serving engine's device prefix cache or the store). Failed requests are counted apart and left
out of every other figure. Rates are in [0, 1], times in seconds, throughputs per wall second.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvledger.bench.replay_client import ReplayOutcome
from kvledger.bench.replay_drive import Calibration
from kvledger.bench.replay_scale import ScaledRequest
from kvledger.bench.sim_core import SimConfig, percentile, simulate
from kvledger.bench.trace import TraceRequest
from kvledger.core import ModelSpec

ASSUMED_PREFILL_TPS = 1000.0   # only when the calibration probes failed (said in the report)
ASSUMED_FETCH_BPS = 10e9       # only when the run fetched nothing from the store (said in the report)
ASSUMED_DECODE_TPS = 30.0


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q), 4) if values else None


def summarize(outcomes: Sequence[ReplayOutcome], wall_s: float) -> dict[str, Any]:
    """The live figures of one run (see the module docstring)."""
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    device = sum(o.device_cached_tokens for o in ok)
    cold = [o.ttft_s for o in ok if o.cached_tokens == 0]
    warm = [o.ttft_s for o in ok if o.cached_tokens > 0]
    errors = [o for o in outcomes if not o.ok]
    return {
        "requests": len(outcomes), "ok_requests": len(ok), "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "token_hit_rate": cached / prompt if prompt else 0.0,
        "device_cached_tokens": device, "store_cached_tokens": cached - device,
        "store_share_of_hits": (cached - device) / cached if cached else None,
        "device_share_of_hits": device / cached if cached else None,
        "cold_requests": len(cold), "warm_requests": len(warm),
        "ttft_p50_cold_s": _pct(cold, 50), "ttft_p99_cold_s": _pct(cold, 99),
        "ttft_p50_warm_s": _pct(warm, 50), "ttft_p99_warm_s": _pct(warm, 99),
        "ttft_p50_s": _pct([o.ttft_s for o in ok], 50),
        "wall_s": round(wall_s, 3), "requests_per_s": len(ok) / wall_s if wall_s else None,
        "prompt_tokens_per_s": prompt / wall_s if wall_s else None,
        "output_tokens_per_s": sum(o.completion_tokens for o in ok) / wall_s if wall_s else None,
        "decode_tokens_per_s": decode_rate(ok),
        "hit_kinds": dict(Counter(o.hit_kind or "unknown" for o in ok)),
        "engines": dict(Counter(str(o.engine) for o in ok)),
    }


def decode_rate(ok: Sequence[ReplayOutcome]) -> float | None:
    """Median tokens/s of one request's decode (after its first token), over the requests that had one."""
    rates = [(o.completion_tokens - 1) / (o.latency_s - o.ttft_s) for o in ok
             if o.completion_tokens > 1 and o.latency_s > o.ttft_s]
    return float(np.median(rates)) if rates else None


def busy_prefill_rate(ok: Sequence[ReplayOutcome]) -> tuple[float | None, float]:
    """(computed prompt tokens per busy second of a prefill engine, busy seconds of all of them).

    An engine is busy while one of its requests is between send and first token (its prefill,
    with whatever queueing and interleaved decode steps it met: a work-conserving engine never
    idles with work queued), so its busy time is the union of those intervals; the rate is what
    the engines delivered under the run's load. Requests are grouped by `usage.kvledger.engine`."""
    by_engine: dict[str | None, list[tuple[float, float]]] = {}
    for o in ok:
        by_engine.setdefault(o.engine, []).append((o.sent_at, o.sent_at + o.ttft_s))
    busy = 0.0
    for intervals in by_engine.values():
        intervals.sort()
        start, end = intervals[0]
        for a, b in intervals[1:]:
            if a > end:
                busy, start = busy + end - start, a
            end = max(end, b)
        busy += end - start
    computed = sum(o.prompt_tokens - o.cached_tokens for o in ok)
    return (computed / busy if computed and busy > 0 else None), busy


def sim_config(model: str, engines: tuple[int, int], prefill_tps: float | None, cal: Calibration,
               decode_tps: float | None) -> tuple[SimConfig, dict[str, Any]]:
    """The simulator's cluster for a replay: the live engine counts, the measured rates, and what the
    live store does over a few minutes — nothing expires (TTLs are days), no capacity limit."""
    source = "measured: computed prompt tokens per busy second of the prefill engines in this run"
    if prefill_tps is None:
        prefill_tps = cal.prefill_tokens_per_s
        source = "measured: calibration probes on the idle server"
    if prefill_tps is None:
        prefill_tps, source = ASSUMED_PREFILL_TPS, "assumed"
    fetch = cal.read_bytes_per_s or ASSUMED_FETCH_BPS
    cfg = SimConfig(spec=ModelSpec.preset(model), prefill_engines=engines[0], decode_engines=engines[1],
                    prefill_tps=prefill_tps, fetch_bytes_per_s=fetch, decode_tps=decode_tps or ASSUMED_DECODE_TPS,
                    ttl_s=None, routing="match", swa="memory")
    assumptions = {
        "model": model, "prefill_engines": engines[0], "decode_engines": engines[1],
        "prefill_tokens_per_s": prefill_tps, "prefill_tps_source": source,
        "fetch_bytes_per_s": fetch, "fetch_source": "measured: hit bytes per fetch second (responses, /metrics)"
        if cal.read_bytes_per_s else "assumed",
        "decode_tokens_per_s": cfg.decode_tps, "decode_tps_source": "measured" if decode_tps else "assumed",
        "ttl": "none (the live TTLs are days; the run lasts minutes)", "capacity": "unlimited",
        "routing": "match: one shared store, hit decided at arrival from blocks whose writer's prefill ended",
    }
    return cfg, assumptions


def as_sent(requests: Sequence[ScaledRequest], outcomes: Sequence[ReplayOutcome]) -> list[TraceRequest]:
    """The simulator's requests, each arriving when the replay really sent it (its scaled arrival
    time, unless the in-flight limit held it back: `late_sends`), sorted by that time."""
    assert [r.index for r in requests] == [o.index for o in outcomes]
    return sorted((replace(r.sim, arrival_s=o.sent_at) for r, o in zip(requests, outcomes)),
                  key=lambda r: r.arrival_s)


def predict(requests: Sequence[TraceRequest], cfg: SimConfig) -> dict[str, Any]:
    """`kvledger bench sim`'s figures for the scaled requests, in this process."""
    res = simulate(requests, cfg)
    return {"token_hit_rate": res.token_hit_rate, "block_hit_rate": res.block_hit_rate,
            "prompt_tokens": res.prompt_tokens, "hit_tokens": res.hit_tokens,
            "ttft_p50_s": _pct(res.ttft_s, 50), "ttft_p99_s": _pct(res.ttft_s, 99), "hit_kinds": res.kinds}


def policy_report(policy: str, server: str, outcomes: Sequence[ReplayOutcome], wall_s: float, late: int,
                  requests: Sequence[ScaledRequest], cal: Calibration, engines: tuple[int, int], model: str
                  ) -> dict[str, Any]:
    """One policy's live figures beside the simulator's prediction for the same requests."""
    live = summarize(outcomes, wall_s)
    busy_rate, busy_s = busy_prefill_rate([o for o in outcomes if o.ok])
    cfg, assumptions = sim_config(model, engines, busy_rate, cal, live["decode_tokens_per_s"])
    sim_requests = as_sent(requests, outcomes)
    sim = predict(sim_requests, cfg)
    return {"sim_requests": sim_requests, "routing": policy, "server": server, **live, "late_sends": late,
            "sim_token_hit_rate": sim["token_hit_rate"],
            "hit_rate_gap": live["token_hit_rate"] - sim["token_hit_rate"],
            "prefill_tokens_per_s": cfg.prefill_tps, "prefill_busy_s": busy_s,
            "prefill_tokens_per_s_idle": cal.prefill_tokens_per_s, "read_bytes_per_s": cal.read_bytes_per_s,
            "store_read_bytes_per_s": cal.store_read_bytes_per_s,
            "calibration": cal.to_json(), "sim": {**sim, "assumptions": assumptions}}
