"""`kvledger whatif --trace DATA_DIR`: the simulator on a server's own recorded trace, with other capacities, TTL
classes, routing policies and SWA strategies, beside what the live server measured over the same window
(bench/whatif.py says how it is calibrated). The server's `GET /whatif` answers the same JSON.

Bad input is one line and exit 2: a missing or empty trace, a bad size, duration or policy, a value past its
bound (below). A damaged line (a crash or a full disk cut the file) is a warning on stderr naming it; the
requests before it are used.

Bounds (what an operator asks of a real cluster; `GET /whatif` passes its query here, so they are the server's
too, and its 400 names them). A run costs one simulation per row, each O(requests × engines): 100,000 engines
took 300 s of CPU, 10^8 allocated 2.8 GiB; 1,024 engines over a 400-request window add 0.4 s.

    --prefill-engines, --decode-engines   1 .. MAX_ENGINES (1,024) simulated engines
    --capacity, --ttl, --routing          at most MAX_VALUES (8) values each: one row each
    --capacity                            (0, MAX_CAPACITY_BYTES] (1 EB), or inf (unlimited)
    --ttl                                 (0, MAX_TTL_S] (365 days) for every class
    --last                                1 .. MAX_LAST (10,000,000) requests; a default trace folder
                                          (5 files of 32 MiB) holds well under 1 M
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

from kvledger.util.output import CliError, emit_json, examples

HELP = "the simulator on the server's own recorded traffic: hit rate and TTFT with other settings, beside the live"
MAX_ENGINES = 1024
MAX_VALUES = 8
MAX_CAPACITY_BYTES = 1e18
MAX_TTL_S = 365 * 86_400.0
MAX_LAST = 10_000_000


def register(sub: argparse._SubParsersAction) -> None:
    from kvledger.bench.sim_core import ENGINE_POLICIES
    from kvledger.core import ModelSpec

    p = sub.add_parser("whatif", help=HELP, description=(__doc__ or HELP).strip().split("\n\n")[0],
                       epilog=examples("kvledger whatif --trace ~/.local/share/kvledger/data",
                                       "kvledger whatif --trace /var/lib/kvledger --capacity 2G --ttl 1h "
                                       "--routing round-robin --prefill-engines 4 --json",
                                       "kvledger whatif --trace DATA_DIR --out whatif/   # + whatif.json, whatif.png"))
    p.add_argument("--trace", required=True, metavar="PATH", help="a server's --data-dir, its trace folder, or one "
                   "recorded JSONL file")
    p.add_argument("--last", type=int, default=None, metavar="N", help="only the last N requests (default: all; "
                   f"at most {MAX_LAST:,})")
    p.add_argument("--model", default=None, help=f"one of: {', '.join(ModelSpec.presets())} (default: the server's, "
                   "from its trace folder's server.json)")
    p.add_argument("--capacity", action="append", default=[], metavar="SIZE", help="a store capacity to try (8G, "
                   f"500MB, inf; at most 1 EB); repeat for more, up to {MAX_VALUES} (default: 1/2, 1/4, 1/8 of the "
                   "peak as recorded, and unlimited)")
    p.add_argument("--ttl", action="append", default=[], metavar="SPEC", help="TTL classes to try: one duration for "
                   "every class (30s, 2h, 7d; at most 365d) or agent=30s,chatbot=2h (a class not named keeps the "
                   f"server's); repeat for more, up to {MAX_VALUES} (default: 1/2, 1/8, 1/32 of the window's span)")
    p.add_argument("--routing", action="append", default=[], choices=ENGINE_POLICIES, help="a routing policy of the "
                   f"live router to try over the shared store; repeat for more, up to {MAX_VALUES} (default: all four, "
                   "and the simulator's per-engine local caches)")
    p.add_argument("--prefill-engines", type=int, default=None, metavar="N", help="engines of the routing rows "
                   f"(default: the window's, at least 2; at most {MAX_ENGINES})")
    p.add_argument("--decode-engines", type=int, default=1, metavar="M", help="decode engines simulated (at most "
                   f"{MAX_ENGINES})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="DIR", help="write whatif.json and the chart whatif.png into DIR")
    p.set_defaults(func=run)


def report_of(args: argparse.Namespace) -> dict[str, Any]:
    """The what-if report of the parsed arguments; CliError (one line) for bad input."""
    from kvledger.bench.trace import TraceError
    from kvledger.bench.whatif import whatif
    from kvledger.bench.whatif_trace import load_recorded, ttl_seconds
    from kvledger.store.ttl import DEFAULT_CLASSES

    _check_bounds(args)
    capacities = [_capacity(text) for text in args.capacity]
    try:
        recorded = load_recorded(args.trace, args.last)
    except TraceError as e:
        raise CliError(str(e)) from None
    spec = _spec(args.model or recorded.server.get("model"), recorded.trace.source)
    bad = {r.block_tokens for r in recorded.trace.requests if r.block_tokens % spec.block_size}
    if bad:
        raise CliError(f"{args.trace}: blocks of {min(bad)} tokens are not whole {spec.block_size}-token blocks of "
                       f"{spec.name}")
    server_ttl = ttl_seconds(recorded.server) or dict(DEFAULT_CLASSES)
    ttls = [_ttl(text, server_ttl) for text in args.ttl]
    for warning in recorded.warnings:
        print(f"kvledger whatif: warning: {warning}", file=sys.stderr, flush=True)
    return whatif(recorded, spec, capacities=capacities, ttls=ttls, routings=args.routing,
                  engines=args.prefill_engines, decode_engines=args.decode_engines)


def _check_bounds(args: argparse.Namespace) -> None:
    """CliError naming the flag and its bound for a count or a number of values past it (module docstring)."""
    for flag, value, top in (("last", args.last, MAX_LAST), ("prefill_engines", args.prefill_engines, MAX_ENGINES),
                             ("decode_engines", args.decode_engines, MAX_ENGINES)):
        name = f"--{flag.replace('_', '-')}"
        if value is not None and value < 1:
            raise CliError(f"{name} must be >= 1")
        if value is not None and value > top:
            raise CliError(f"{name} must be at most {top} (the what-if's bound), got {value}")
    for flag in ("capacity", "ttl", "routing"):
        if len(getattr(args, flag)) > MAX_VALUES:
            raise CliError(f"--{flag}: at most {MAX_VALUES} values (one simulated row each: the what-if's bound), "
                           f"got {len(getattr(args, flag))}")


def _spec(name: Any, source: str) -> Any:
    from kvledger.core import ModelSpec

    if not isinstance(name, str):
        raise CliError(f"{source}: the trace folder names no model (no server.json): give --model")
    try:
        return ModelSpec.preset(name)
    except ValueError as e:
        raise CliError(f"--model: {e}") from None


def _capacity(text: str) -> float:
    from kvledger.util.units import parse_size

    try:
        size = parse_size(text)
    except ValueError as e:
        raise CliError(f"--capacity: {e}") from None
    if size <= 0:
        raise CliError("--capacity must be > 0")
    if MAX_CAPACITY_BYTES < size < math.inf:
        raise CliError(f"--capacity must be at most {MAX_CAPACITY_BYTES:g} bytes (the what-if's bound; inf for "
                       f"unlimited), got {text}")
    return size


def _ttl(text: str, server: dict[str, float]) -> dict[str, float]:
    from kvledger.entrypoint.config import parse_ttl_classes

    try:
        classes = parse_ttl_classes(text, server)
    except ValueError as e:
        raise CliError(f"--ttl: {e}") from None
    if any(ttl > MAX_TTL_S for name, ttl in classes.items() if ttl != server.get(name)):   # the named ones
        raise CliError(f"--ttl must be at most {MAX_TTL_S / 86_400:g} days for every class (the what-if's bound), "
                       f"got {text}")
    return classes


def run(args: argparse.Namespace) -> None:
    if args.out and importlib.util.find_spec("matplotlib") is None:   # the one part that needs the bench extra
        raise CliError("--out draws whatif.png with matplotlib, which is not installed: pip install "
                       "'kvledger[bench]' (or leave out --out)")
    report = report_of(args)
    if args.out:
        from kvledger.bench import plots
        from kvledger.util.output import dumps_strict

        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "whatif.json").write_text(dumps_strict(report, indent=1) + "\n")
        except OSError as e:
            raise CliError(f"--out {out}: {e.strerror or e}") from None
        plots.whatif_chart(out / "whatif.png", report)
    if args.json:
        emit_json(report)
    else:
        table(report)


def _cell(value: Any, digits: str = ".3f") -> str:
    return "—" if value is None else format(value, digits)


def table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cal, live, rec = report["calibration"], report["live"], report["as_recorded"]
    console = Console(width=130)
    console.print(f"[bold]{report['source']}[/]: {report['requests']} requests over {report['span_s']:.0f} s "
                  f"(reuse ceiling {report['reuse_ceiling']:.3f}); model {report['assumptions']['model']}, "
                  f"{report['assumptions']['prefill_engines']} prefill engine(s)")
    console.print(f"calibration: prefill {cal['prefill_tokens_per_s']:.0f} tok/s ({cal['prefill_source']}); fetch "
                  f"{cal['fetch_bytes_per_s'] / 1e9:.3g} GB/s ({cal['fetch_source']}); TTFT overhead "
                  f"{cal['ttft_overhead_s'] * 1e3:.1f} ms")
    t = Table(show_header=True)
    for col in ("what", "setting", "token hit rate", "Δ vs as recorded", "block hit rate", "TTFT p50 (s)",
                "TTFT p99 (s)"):
        t.add_column(col, justify="left" if col in ("what", "setting") else "right")
    t.add_row("live (measured)", "the same window", _cell(live["token_hit_rate"]), "",
              _cell(live["block_hit_rate"]), _cell(live["ttft_p50_s"], ".3g"), _cell(live["ttft_p99_s"], ".3g"))
    for r in (rec, *report["rows"]):
        t.add_row(r["change"], r["setting"], _cell(r["token_hit_rate"]), _cell(r["token_hit_rate_change"], "+.3f"),
                  _cell(r["block_hit_rate"]), _cell(r["ttft_p50_s"], ".3g"), _cell(r["ttft_p99_s"], ".3g"))
    console.print(t)
