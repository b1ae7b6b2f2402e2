"""`kvledger bench whatif`: the what-if's prediction against a live rerun, one changed setting at a time.

1. A workload (scaled as `bench replay` scales it) is sent open loop to a fresh `kvledger serve`, which
   records its own trace (the baseline). Its engine's device pool is small (`--device-blocks`, through
   `serve --kv-cache-bytes`), as a GPU's is beside its store, so the block ledger, not the device prefix
   cache, keeps most of what later requests find (the what-if models both).
2. `kvledger whatif` (bench/whatif.py) on that trace predicts the token hit rate for each changed setting:
   a smaller store (`--store-capacity`), a shorter TTL (`--ttl-classes`, seconds), and another routing
   policy (`kvledger up --both N --routing POLICY`: N engines over the shared store).
3. Each setting is then run live: the same requests at the same times to a fresh server started with it.

It prints, per setting, the predicted and the live token hit rate (Σ cached / Σ prompt tokens, from the
responses) and their gap, beside the baseline's live figure (the change moved the rate that far) and the
simulator's error on the baseline itself. Done when every gap is within `--tolerance`.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from kvledger.util.output import CliError

HELP = "the what-if's prediction against a live rerun, for a smaller capacity, a shorter TTL, another routing"
EXAMPLES = ("kvledger bench whatif --record docs/results   # about 10 min: the run docs/simulator.md quotes",
            "kvledger bench whatif --sessions 16 --duration 15 --ttl 2s --settings capacity,ttl --json   # a minute")
SETTINGS = ("capacity", "ttl", "routing")
AUTO_CAPACITY_SHARE = 0.3    # --capacity auto: this share of the baseline's store peak (as the simulator sees it)
AUTO_TTL_SHARE = 1 / 50      # --ttl auto: this share of the baseline window's span
VOCAB = 32_000               # token ids are drawn below the smallest vocabulary of the presets (tiny-v4's)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.bench.sim_core import ENGINE_POLICIES
    from kvledger.bench.workloads import WORKLOADS
    from kvledger.engine.models import registry

    p.add_argument("--workload", choices=WORKLOADS, default="chat", help="the generated workload")
    p.add_argument("--sessions", type=int, default=40, help="workload sessions")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--model", default="tiny-v4", choices=registry.NAMES, help="the servers' model")
    p.add_argument("--length-scale", type=float, default=0.5, help="factor on every length (as bench replay)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="context cap (rounded down to 128s)")
    p.add_argument("--max-tokens", type=int, default=4, help="cap on generated tokens per request")
    p.add_argument("--max-requests", type=int, default=400, help="the first N requests by arrival")
    p.add_argument("--duration", type=float, default=150.0, help="seconds the arrivals are compressed into")
    p.add_argument("--device-blocks", type=int, default=24, help="the serve runs' device pool in blocks (serve "
                   "--kv-cache-bytes; at least one request of --max-prompt-tokens + --max-tokens)")
    p.add_argument("--max-inflight", type=int, default=16, help="requests in flight at once")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which changed settings to run live, of "
                   f"{', '.join(SETTINGS)}")
    p.add_argument("--capacity", default="auto", help="the smaller store (500K, 2M) or auto: "
                   f"{AUTO_CAPACITY_SHARE:g} of the baseline's store peak")
    p.add_argument("--ttl", default="auto", help="the shorter TTL of every class (4s, 1m) or auto: "
                   f"1/{round(1 / AUTO_TTL_SHARE)} of the baseline window's span")
    p.add_argument("--routing", default="round-robin", choices=ENGINE_POLICIES, help="the other routing policy")
    p.add_argument("--engines", type=int, default=2, help="engines of the routing run (kvledger up --both N)")
    p.add_argument("--tolerance", type=float, default=0.05, help="the largest gap that agrees")


def check(args: argparse.Namespace) -> list[str]:
    """The settings to run; CliError for a bad flag."""
    for name in ("sessions", "max_tokens", "max_requests", "max_inflight", "engines", "device_blocks"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("length_scale", "duration", "timeout", "tolerance"):
        if not getattr(args, name) > 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0")
    if args.max_prompt_tokens < 128:
        raise CliError("--max-prompt-tokens must be >= 128")
    chosen = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not chosen or any(s not in SETTINGS for s in chosen):
        raise CliError(f"--settings: a comma-separated list of {', '.join(SETTINGS)}, got {args.settings!r}")
    _setting_value(args.capacity, "--capacity")
    _setting_value(args.ttl, "--ttl")
    return chosen


def _setting_value(text: str, flag: str) -> float | None:
    """None for auto, else bytes (--capacity) or seconds (--ttl)."""
    from kvledger.util.units import parse_duration, parse_size

    if text == "auto":
        return None
    try:
        value = parse_size(text) if flag == "--capacity" else parse_duration(text)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None
    if not (math.isfinite(value) and value > 0):
        raise CliError(f"{flag} must be a finite size > 0")
    return value


def requests_of(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """(the scaling, the scaled requests), token ids below VOCAB (equal ids stay equal: a prefix stays shared)."""
    from dataclasses import replace

    from kvledger.bench.replay_scale import make_scaling, scale_trace
    from kvledger.bench.workloads import generate

    try:
        trace = generate(args.workload, args.seed, args.sessions)
        scaling = make_scaling(trace, args.length_scale, args.max_prompt_tokens, args.max_tokens, args.max_requests,
                               args.duration, None)
    except ValueError as e:
        raise CliError(str(e)) from None
    return scaling, [replace(r, tokens=r.tokens % VOCAB) for r in scale_trace(trace, scaling)]


def live(args: argparse.Namespace, requests: list[Any], url: str, label: str) -> dict[str, Any]:
    """Send the requests open loop at their times; the live figures of the responses (replay_report.summarize)."""
    from kvledger.bench import replay_drive as drive
    from kvledger.bench.replay_progress import progress
    from kvledger.bench.replay_report import summarize

    target = drive.Target(url, args.model, "whatif", None, args.timeout)
    with progress(len(requests), label) as on_done:
        outcomes, wall, late = drive.drive(target, requests, args.max_inflight, on_done)
    figures = summarize(outcomes, wall)
    if figures["errors"]:
        raise CliError(f"{label}: {figures['errors']} of {len(requests)} requests failed: {figures['first_error']}")
    return {**{k: figures[k] for k in ("requests", "prompt_tokens", "cached_tokens", "token_hit_rate", "ttft_p50_s",
                                      "wall_s")}, "late_sends": late}


def serve_run(args: argparse.Namespace, requests: list[Any], folder: Path, label: str, *flags: str) -> dict[str, Any]:
    """One fresh `kvledger serve` with `flags` and the small device pool, driven by the requests."""
    from kvledger.core import ModelSpec
    from kvledger.util.serve_process import ServeProcess

    pool = ("--kv-cache-bytes", str(args.device_blocks * ModelSpec.preset(args.model).block_bytes()),
            "--max-prompt-tokens", str(args.max_prompt_tokens), "--max-tokens-limit", str(args.max_tokens))
    server = ServeProcess(folder, "--max-concurrent-per-key", "256", *pool, *flags, model=args.model)
    try:
        server.start()
        return {"server": " ".join(["kvledger serve", *pool, *flags]), **live(args, requests, server.url, label)}
    finally:
        server.stop()


def cluster_run(args: argparse.Namespace, requests: list[Any], folder: Path, label: str) -> dict[str, Any]:
    """One fresh `kvledger up --both N --routing POLICY`, driven by the requests."""
    from kvledger.entrypoint.cluster_process import ClusterProcess

    with ClusterProcess(folder, prefill=0, decode=0, both=args.engines, routing=args.routing, model=args.model) as c:
        return {"server": f"kvledger up --both {args.engines} --routing {args.routing}",
                **live(args, requests, c.url, label)}


def changes(args: argparse.Namespace, chosen: list[str], recorded: Any, spec: Any) -> dict[str, Any]:
    """Per chosen setting: its what-if Change and the live server's flags (auto values from the baseline)."""
    from kvledger.bench.sim_core import simulate
    from kvledger.bench.whatif import Change, base_config, calibrate
    from kvledger.engine.defaults import DEFAULTS
    from kvledger.bench.whatif_trace import live_figures

    out: dict[str, Any] = {}
    if "capacity" in chosen:
        size = _setting_value(args.capacity, "--capacity")
        if size is None:
            base = base_config(recorded, spec, calibrate(recorded.trace.requests, spec))
            peak = max((b for _, b in simulate(recorded.trace.requests, base).store_series), default=0)
            size = float(max(int(peak * AUTO_CAPACITY_SHARE), spec.block_bytes()))
        out["capacity"] = (Change("capacity", f"{int(size):,} bytes", {"capacity_bytes": float(int(size))}),
                           ("--store-capacity", str(int(size))), int(size))
    if "ttl" in chosen:
        ttl = _setting_value(args.ttl, "--ttl") or round(live_figures(recorded.trace.requests)["span_s"]
                                                          * AUTO_TTL_SHARE, 1) or 1.0
        out["ttl"] = (Change("ttl", f"{ttl:g} s, every class", {"ttl_s": {"agent": ttl, "chatbot": ttl}}),
                      ("--ttl-classes", f"{ttl:g}s"), ttl)
    if "routing" in chosen:   # `up`'s engines keep their default device pool
        setting = f"{args.routing}, {args.engines} engines, shared store"
        device = max(DEFAULTS.kv_cache_bytes // spec.block_bytes(), 1)
        out["routing"] = (Change("routing", setting, {"routing": "match", "engine_policy": args.routing,
                                                      "prefill_engines": args.engines, "device_blocks": device}),
                          (), args.routing)
    return out


def run(args: argparse.Namespace) -> None:
    from kvledger.bench.trace import TraceError
    from kvledger.bench.whatif import whatif
    from kvledger.bench.whatif_trace import load_recorded
    from kvledger.core import ModelSpec
    from kvledger.util.output import emit_json

    chosen = check(args)
    scaling, requests = requests_of(args)
    spec = ModelSpec.preset(args.model)
    # The servers compute with one torch thread unless OMP_NUM_THREADS says otherwise. A replay must keep to
    # the trace's times on the machine its own driver and the engines' fetchers share, and torch's threads (one
    # per core) wait for each other at every operation once another process takes a core: on 2 cores tiny-v4's
    # TTFT went from 0.09 s to 1.0-1.6 s, runs fell behind their trace, and the simulator's timing no longer held.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-whatif-") as tmp:
        root = Path(tmp)
        baseline = serve_run(args, requests, root / "baseline", "baseline")
        try:
            recorded = load_recorded(root / "baseline")
        except TraceError as e:
            raise CliError(f"the baseline recorded no trace: {e}") from None
        if args.out:   # every run's own recorded trace, for `kvledger whatif --trace DIR/NAME`
            _keep_traces(root, Path(args.out))
        planned = changes(args, chosen, recorded, spec)
        report = whatif(recorded, spec, [c for c, _, _ in planned.values()])
        predicted = {row["setting"]: row for row in report["rows"]}
        results = []
        for name, (change, flags, value) in planned.items():
            run_live = (cluster_run(args, requests, root / name, name) if name == "routing"
                        else serve_run(args, requests, root / name, name, *flags))
            if args.out:
                _keep_traces(root, Path(args.out))
            row = predicted[change.setting]
            gap = run_live["token_hit_rate"] - row["token_hit_rate"]
            results.append({"setting": name, "value": value, "what_if": change.setting,
                            "predicted_token_hit_rate": row["token_hit_rate"],
                            "live_token_hit_rate": run_live["token_hit_rate"], "gap": gap,
                            "agrees": abs(gap) <= args.tolerance, "predicted_ttft_p50_s": row["ttft_p50_s"],
                            "live": run_live})
    out = {"bench": "whatif", "model": args.model, "workload": args.workload, "sessions": args.sessions,
           "requests": len(requests), "scaling": scaling.describe(), "tolerance": args.tolerance,
           "max_gap": max((abs(r["gap"]) for r in results), default=0.0),
           "all_agree": all(r["agrees"] for r in results), "settings": results,
           "baseline": {"live": baseline, "live_token_hit_rate": baseline["token_hit_rate"],
                        "as_recorded_token_hit_rate": report["as_recorded"]["token_hit_rate"],
                        "recorded_live_token_hit_rate": report["live"]["token_hit_rate"],
                        "calibration": report["calibration"], "assumptions": report["assumptions"]},
           "measure": "token hit rate = Σ cached / Σ prompt tokens of the responses; predicted by kvledger whatif on "
                      "the baseline's own recorded trace"}
    if args.out:
        from kvledger.util.output import dumps_strict

        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "whatif_bench.json").write_text(dumps_strict(out, indent=1) + "\n")
    if args.json:
        emit_json(out)
    else:
        _table(out)


def _keep_traces(root: Path, out: Path) -> None:
    """Copy each run's trace folder (`<run>/trace`) to `out/<run>-trace`."""
    import shutil

    for folder in sorted(root.glob("*/trace")):
        shutil.copytree(folder, out / f"{folder.parent.name}-trace", dirs_exist_ok=True)


def _table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    b = out["baseline"]
    t = Table(title=f"kvledger bench whatif: {out['requests']} requests of {out['workload']} on {out['model']}; "
                    f"baseline live {b['live_token_hit_rate']:.3f}, simulated as recorded "
                    f"{b['as_recorded_token_hit_rate']:.3f}")
    for col in ("setting", "what if", "predicted", "live", "gap", f"within {out['tolerance']:g}"):
        t.add_column(col, justify="left" if col in ("setting", "what if") else "right")
    for r in out["settings"]:
        t.add_row(r["setting"], r["what_if"], f"{r['predicted_token_hit_rate']:.3f}", f"{r['live_token_hit_rate']:.3f}",
                  f"{r['gap']:+.3f}", "yes" if r["agrees"] else "NO")
    Console().print(t)
