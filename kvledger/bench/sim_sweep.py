"""The sweeps behind the simulator tables of docs/simulator.md: one base config, one knob varied per row.

Every row is a full simulator run over the same requests; rates are in [0, 1], times in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvledger.bench.sim_core import ROUTINGS, SimConfig, downsample, percentile, simulate
from kvledger.bench.trace import TTL_CLASSES, TraceRequest

SWEEPS = ("ttl", "capacity", "routing", "swa")
TTL_DAYS = (None, 7.0, 3.0, 1.0, 0.25)
CAPACITY_GB = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, math.inf)
SWA_ROWS = (("memory", "memory", 4, False), ("memory+replay", "memory", 4, True), ("shared", "shared", 4, False),
            ("zero", "zero", 4, True),
            ("periodic:4", "periodic", 4, False), ("periodic:16", "periodic", 16, False), ("full", "full", 4, False))


def _row(requests: Sequence[TraceRequest], cfg: SimConfig, **labels: Any) -> dict[str, Any]:
    res = simulate(requests, cfg)
    hits = sum(v for k, v in res.kinds.items() if k != "miss")
    peak = max((b for _, b in res.store_series), default=0)
    return {**labels, "block_hit_rate": res.block_hit_rate, "token_hit_rate": res.token_hit_rate,
            "ttft_p50_s": percentile(res.ttft_s, 50), "ttft_p99_s": percentile(res.ttft_s, 99),
            "snapshot_share_of_hits": res.kinds.get("snapshot", 0) / hits if hits else 0.0,
            "computed_share": res.computed_tokens / res.prompt_tokens if res.prompt_tokens else 0.0,
            "first_turn_hit_share": res.first_turn_hit_share,
            "store_gb_max": peak / 1e9, "evicted_gb": res.evicted_bytes / 1e9,
            "state_pool_gb": res.state_pool_bytes / 1e9, "store_size_over_time": downsample(res.store_series, 100)}


def _gb(capacity: float) -> float | None:
    return None if math.isinf(capacity) else capacity / 1e9


def run_sweep(name: str, requests: Sequence[TraceRequest], base: SimConfig, sweep_capacity: float,
              span_days: float, span_s: float) -> dict[str, Any]:
    """{"columns": [...], "rows": [...]} for sweep `name` around `base`."""
    assert name in SWEEPS
    base = replace(base, ideal=False)
    rows: list[dict[str, Any]] = []
    if name == "ttl":
        cols = ["ttl_days", "ttl_s"]
        for days in TTL_DAYS:
            ttl = None if days is None else dict.fromkeys(TTL_CLASSES, days / span_days * span_s)
            rows.append(_row(requests, replace(base, ttl_s=ttl), ttl_days=days,
                             ttl_s=None if ttl is None else days / span_days * span_s))
    elif name == "capacity":
        cols = ["capacity_gb"]
        for gb in CAPACITY_GB:
            rows.append(_row(requests, replace(base, capacity_bytes=gb * 1e9), capacity_gb=_gb(gb * 1e9)))
    elif name == "routing":
        cols = ["routing", "capacity_gb"]
        for cap in (base.capacity_bytes, sweep_capacity):
            for routing in ROUTINGS:
                rows.append(_row(requests, replace(base, routing=routing, capacity_bytes=cap),
                                 routing=routing, capacity_gb=_gb(cap)))
    else:
        cols = ["swa", "capacity_gb"]
        for cap in (base.capacity_bytes, sweep_capacity):
            for label, swa, period, replay in SWA_ROWS:
                cfg = replace(base, swa=swa, swa_period=period, replay=replay, capacity_bytes=cap)
                rows.append(_row(requests, cfg, swa=label, capacity_gb=_gb(cap)))
    return {"columns": cols, "rows": rows}
