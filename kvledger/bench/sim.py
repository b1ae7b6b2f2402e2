"""`kvledger bench sim`: the cluster simulator, driven by a Mooncake trace or a generated workload.

Prints the hit rates, the TTFT distribution and the store size over time of one run, side by
side with the same cluster without a cache tier (baseline), or one of the sweeps docs/simulator.md
tables come from (`--sweep ttl|capacity|routing|swa`).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvledger.bench import sim_sweep
from kvledger.bench.sim_core import ROUTINGS, SimConfig, SimResult, downsample, percentile, reuse_ceiling, simulate
from kvledger.bench.trace import DEFAULT_TRACE, TTL_CLASSES, Trace, TraceError, read_trace, write_trace
from kvledger.bench.workloads import WORKLOADS, generate
from kvledger.core import ModelSpec
from kvledger.core.plan import DEFAULT_TTL_DAYS, PUBLISHED_PREFILL_TOKENS_PER_S
from kvledger.util import units
from kvledger.util.output import CliError, dumps_strict, emit_json, loads_strict

HELP = "cluster simulator: hit rate, TTFT and store size vs TTL, capacity, routing, SWA strategy"
EXAMPLES = (  # `--help`'s epilog
    "kvledger bench sim",
    "kvledger bench sim --workload chat --sweep swa --sweep-capacity 2G",
)


def parse_size(text: str, flag: str = "--capacity") -> float:
    """'8G', '500MB', '1.5TiB', '123' (bytes) or 'inf' → bytes (decimal units unless …iB; util/units.py)."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


def parse_ttl(text: str) -> dict[str, float] | None:
    """'none' → None; 'D' → every class D days; 'agent=3,chatbot=7' → per class (others keep defaults)."""
    if text.strip().lower() == "none":
        return None
    try:
        if "=" not in text:
            days = float(text)
            out = dict.fromkeys(TTL_CLASSES, days)
        else:
            out = dict(DEFAULT_TTL_DAYS)
            for part in filter(None, text.split(",")):
                name, _, value = part.partition("=")
                if name.strip() not in TTL_CLASSES:
                    raise ValueError
                out[name.strip()] = float(value)
    except ValueError:
        raise CliError(f"--ttl: expected none, DAYS or agent=DAYS,chatbot=DAYS, got {text!r}") from None
    if any(not math.isfinite(d) or d <= 0 for d in out.values()):
        raise CliError("--ttl: days must be > 0")
    return out


def parse_swa(text: str) -> tuple[str, int]:
    m = re.fullmatch(r"(memory|shared|full|zero|periodic)(?::([0-9]+))?", text.strip())
    if not m or (m.group(2) and m.group(1) != "periodic") or (m.group(2) is not None and int(m.group(2)) < 1):
        raise CliError(f"--swa: expected memory, shared, full, zero or periodic:N (N >= 1 blocks), got {text!r}")
    return m.group(1), int(m.group(2) or 4)


def _positive(value: Any) -> float | None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def read_calibration(path: str) -> tuple[float | None, float | None]:
    """(`read_bytes_per_s`, `prefill_tokens_per_s`) from a calibration JSON, each at the top level
    or nested (the first one found): `kvledger bench store --json` gives the first, `kvledger bench
    replay --json` both (the second measured on the live engines, the first when the run fetched).
    At least one must be a positive number."""
    try:
        obj = loads_strict(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CliError(f"--calibration {path}: cannot read JSON ({e})") from None

    def find(o: Any, key: str) -> float | None:
        if isinstance(o, dict):
            if (found := _positive(o.get(key))) is not None:
                return found
            o = list(o.values())
        if isinstance(o, list):
            for v in o:
                if (found := find(v, key)) is not None:
                    return found
        return None

    fetch, prefill = find(obj, "read_bytes_per_s"), find(obj, "prefill_tokens_per_s")
    if fetch is None and prefill is None:
        raise CliError(f"--calibration {path}: no positive 'read_bytes_per_s' (or 'prefill_tokens_per_s') in it")
    return fetch, prefill


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.core.spec import PUBLISHED_MODEL

    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (default: the synthetic one in data/traces)")
    src.add_argument("--workload", choices=WORKLOADS, help="a generated workload instead of a trace")
    p.add_argument("--sessions", type=int, help="workload sessions (default: the generator's)")
    p.add_argument("--seed", type=int, default=0, help="workload and random-routing seed")
    p.add_argument("--model", default=PUBLISHED_MODEL, help=f"one of: {', '.join(ModelSpec.presets())}")
    p.add_argument("--prefill-engines", type=int, default=8, metavar="N", help="prefill engines simulated")
    p.add_argument("--decode-engines", type=int, default=4, metavar="M", help="decode engines simulated")
    p.add_argument("--prefill-tps", type=float, help="prefill tokens/s of one engine (default: DESIGN.md)")
    bw = p.add_mutually_exclusive_group()
    bw.add_argument("--fetch-gbps", type=float, help="storage → host GB/s of one engine (default 10, assumed)")
    bw.add_argument("--calibration", metavar="FILE",
                    help="JSON of `kvledger bench store --json` (read_bytes_per_s) or `kvledger bench replay --json` "
                         "(read_bytes_per_s and prefill_tokens_per_s, measured live)")
    p.add_argument("--fetch-latency-ms", type=float, default=1.0, help="fixed cost of one fetch")
    p.add_argument("--decode-tps", type=float, default=30.0, help="decode tokens/s of one request")
    p.add_argument("--capacity", default="inf", help="store size (8G, 500MB, 1TiB, inf); split per engine when local")
    p.add_argument("--ttl", default="agent=3,chatbot=7", help="none, DAYS, or agent=DAYS,chatbot=DAYS")
    p.add_argument("--span-days", type=float, default=7.0, help="days the trace's span stands for (TTLs scale by it)")
    p.add_argument("--routing", choices=ROUTINGS, default="match",
                   help="match: shared store, hit computed before routing; affinity / random: per-engine caches")
    p.add_argument("--swa", default="memory",
                   help="memory | shared (memory and rule 4″'s branch points and message ends) | full | periodic:N | "
                        "zero (default %(default)s)")
    p.add_argument("--state-slots", type=int, default=4096, help="snapshots one engine's host pool holds (memory)")
    p.add_argument("--replay", action="store_true", help="a missing snapshot: bounded replay instead of fallback")
    p.add_argument("--affinity-balance-s", type=float, default=5.0, help="affinity: queue gap that overrides affinity")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    p.add_argument("--ideal", action="store_true", help="unlimited capacity, no TTL, no hit cap, no in-flight delay")
    p.add_argument("--sweep", choices=sim_sweep.SWEEPS, help="run one of the sweeps of docs/simulator.md")
    p.add_argument("--sweep-capacity", default="8G", help="the limited capacity the routing and swa sweeps add")


def load_requests(args: argparse.Namespace) -> Trace:
    if args.workload:
        try:
            return generate(args.workload, args.seed, args.sessions)
        except ValueError as e:
            raise CliError(f"--{e}") from None
    try:
        return read_trace(args.trace or DEFAULT_TRACE)
    except TraceError as e:
        raise CliError(str(e)) from None


def build_config(args: argparse.Namespace, trace: Trace) -> tuple[SimConfig, dict[str, Any]]:
    """The run's SimConfig and the assumptions it rests on (units in the key names)."""
    try:
        spec = ModelSpec.preset(args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    for name in ("prefill_engines", "decode_engines", "state_slots"):
        if getattr(args, name) < (0 if name == "state_slots" else 1):
            raise CliError(f"--{name.replace('_', '-')} must be >= {0 if name == 'state_slots' else 1}")
    for name in ("prefill_tps", "fetch_gbps", "decode_tps", "span_days", "time_scale"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CliError(f"--{name.replace('_', '-')} must be > 0")
    if args.fetch_latency_ms < 0 or args.affinity_balance_s < 0:
        raise CliError("--fetch-latency-ms and --affinity-balance-s must be >= 0")
    bad = {r.block_tokens for r in trace.requests if r.block_tokens % spec.block_size}
    if bad:
        raise CliError(f"blocks of {min(bad)} tokens in the requests are not whole {spec.block_size}-token blocks")
    cal_fetch, cal_tps = read_calibration(args.calibration) if args.calibration else (None, None)
    if cal_fetch is not None:
        fetch, fetch_src = cal_fetch, f"calibration file {args.calibration}"
    elif args.fetch_gbps is not None:
        fetch, fetch_src = args.fetch_gbps * 1e9, "--fetch-gbps"
    else:
        fetch, fetch_src = 10e9, "assumed default; recalibrate with --calibration"
    if args.prefill_tps:
        tps, tps_src = args.prefill_tps, "--prefill-tps"
    elif cal_tps is not None:
        tps, tps_src = cal_tps, f"calibration file {args.calibration}"
    else:
        tps, tps_src = PUBLISHED_PREFILL_TOKENS_PER_S, "DESIGN.md published: 131072 tokens in 13 s"
    swa, period = parse_swa(args.swa)
    ttl_days = parse_ttl(args.ttl)
    span_s = trace.span_s * args.time_scale
    # a trace without a span (one instant) gives no scale to TTLs: nothing expires
    ttl_s = None if ttl_days is None or span_s == 0 else {k: d / args.span_days * span_s for k, d in ttl_days.items()}
    cfg = SimConfig(spec=spec, prefill_engines=args.prefill_engines, decode_engines=args.decode_engines,
                    prefill_tps=tps, fetch_bytes_per_s=fetch, fetch_latency_s=args.fetch_latency_ms / 1e3,
                    decode_tps=args.decode_tps, capacity_bytes=parse_size(args.capacity), ttl_s=ttl_s,
                    routing=args.routing, swa=swa, swa_period=period, state_slots=args.state_slots,
                    replay=args.replay, affinity_balance_s=args.affinity_balance_s, ideal=args.ideal,
                    seed=args.seed, time_scale=args.time_scale)
    assumptions = {
        "model": spec.name, "block_tokens_model": spec.block_size,
        "block_tokens_requests": sorted({r.block_tokens for r in trace.requests}),
        "prefill_engines": cfg.prefill_engines, "decode_engines": cfg.decode_engines,
        "prefill_tokens_per_s": tps, "prefill_tps_source": tps_src,
        "fetch_bytes_per_s": fetch, "fetch_source": fetch_src, "fetch_latency_s": cfg.fetch_latency_s,
        "decode_tokens_per_s": cfg.decode_tps, "span_s": span_s, "span_days": args.span_days,
        "ttl_days": ttl_days, "ttl_s": ttl_s, "ttl_scaling": "ttl_s = ttl_days / span_days × span_s, renewed on a hit",
        "capacity_bytes": none_if_inf(cfg.capacity_bytes), "routing": cfg.routing, "swa": args.swa,
        "state_slots": cfg.state_slots, "replay": cfg.replay, "ideal": cfg.ideal, "time_scale": cfg.time_scale,
        "service_model": "FIFO per prefill engine; fetch then compute, no overlap; compute linear in tokens",
    }
    return cfg, assumptions


def none_if_inf(x: float) -> float | None:
    return None if math.isinf(x) else x


def summary(res: SimResult, cfg: SimConfig) -> dict[str, Any]:
    """The figures of one run (rates in [0, 1], seconds, bytes)."""
    hits = sum(v for k, v in res.kinds.items() if k != "miss")
    return {
        "requests": res.requests, "block_hit_rate": res.block_hit_rate, "token_hit_rate": res.token_hit_rate,
        "ttft_p50_s": percentile(res.ttft_s, 50), "ttft_p90_s": percentile(res.ttft_s, 90),
        "ttft_p99_s": percentile(res.ttft_s, 99), "ttft_mean_s": sum(res.ttft_s) / max(len(res.ttft_s), 1),
        "hit_kinds": res.kinds, "snapshot_share_of_hits": res.kinds.get("snapshot", 0) / hits if hits else 0.0,
        "store_bytes_max": None if cfg.ideal else max((b for _, b in res.store_series), default=0),
        "store_bytes_final": None if cfg.ideal else (res.store_series[-1][1] if res.store_series else 0),
        "evicted_bytes": res.evicted_bytes, "expired_bytes": res.expired_bytes, "fetch_bytes": res.fetch_bytes,
        "computed_tokens": res.computed_tokens, "decode_blocks_written": res.decode_blocks_written,
        "state_pool_bytes": res.state_pool_bytes,
        "first_turns": res.first_turns, "first_turn_hit_share": res.first_turn_hit_share,
        "prefill_utilization": res.busy_s / (cfg.prefill_engines * res.makespan_s) if res.makespan_s else 0.0,
    }


def run(args: argparse.Namespace) -> None:
    if args.sweep and args.ideal:
        raise CliError("--ideal and --sweep do not combine (a sweep varies a real cluster)")
    trace = load_requests(args)
    cfg, assumptions = build_config(args, trace)
    out = Path(args.out) if args.out else None
    if out:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"--out {out}: {e.strerror or e}") from None
    ceiling = reuse_ceiling(trace.requests)
    if args.sweep:
        sweep_cap = parse_size(args.sweep_capacity, "--sweep-capacity")
        report = sim_sweep.run_sweep(args.sweep, trace.requests, cfg, sweep_cap, args.span_days, assumptions["span_s"])
        report = {"sweep": args.sweep, "source": trace.source, "requests": len(trace), "reuse_ceiling": ceiling,
                  **report, "assumptions": assumptions}
        name = f"sim_sweep_{args.sweep}"
    else:
        res = simulate(trace.requests, cfg)
        base = simulate(trace.requests, replace(cfg, capacity_bytes=0.0, ideal=False))
        s, b = summary(res, cfg), summary(base, cfg)
        report = {"source": trace.source, **s, "reuse_ceiling": ceiling,
                  "baseline_ttft_p50_s": b["ttft_p50_s"], "baseline_ttft_p99_s": b["ttft_p99_s"],
                  "ttft_p50_speedup": b["ttft_p50_s"] / s["ttft_p50_s"] if s["ttft_p50_s"] else None,
                  "ttft_p99_speedup": b["ttft_p99_s"] / s["ttft_p99_s"] if s["ttft_p99_s"] else None,
                  "store_size_over_time": downsample(res.store_series), "assumptions": assumptions}
        name = "sim"
    if out:
        (out / f"{name}.json").write_text(dumps_strict(report, indent=1) + "\n")
        from kvledger.bench import plots

        if args.sweep:
            plots.sweep_chart(out / f"{name}.png", report)
        else:
            plots.ttft_cdf(out / "sim_ttft_cdf.png", {"kvledger": res.ttft_s, "no cache (baseline)": base.ttft_s})
            plots.store_size(out / "sim_store_size.png", res.store_series, cfg.capacity_bytes)
        if args.workload:
            write_trace(trace.requests, out / f"workload_{args.workload}.jsonl")
    if args.json:
        emit_json(report)
    else:
        from kvledger.bench import sim_render

        sim_render.print_report(report)
