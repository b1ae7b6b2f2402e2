"""`kvledger bench replay`: a trace or a workload, scaled down, sent live to a server or a cluster,
per routing policy, beside what the simulator predicts for the same scaled requests.

Without `--url` each policy gets a fresh local cluster (`kvledger up`, or one `kvledger serve` with
`--launcher serve`) on a fresh data directory. Each run: calibration
probes (prefill tokens/s), then the scaled requests open loop at their scaled arrival times
(`replay_drive`), then the report (`replay_report`) with `sim_token_hit_rate` from
`sim_core.simulate` over the same requests, calibrated by the run's measurements.
"""

from __future__ import annotations

import argparse
import secrets
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvledger.bench.replay_scale import ScaledRequest, Scaling
    from kvledger.bench.trace import Trace

HELP = "live trace replay against a server or a local cluster, per routing policy, beside the simulator"
EXAMPLES = ("kvledger bench replay --workload chat --json",)  # `--help`'s epilog
POLICIES = ("cache-aware", "round-robin", "least-loaded", "prefix-affinity")
SESSIONS = {"chat": 8, "agent": 2}
SCALING_HELP = (
    "Scaling (to fit a 2-core CPU): lengths × --length-scale in whole 128-token blocks — every k-th "
    "block id of the source is kept (k = round(128 / (source block × scale)); or each id becomes "
    "round(source block × scale / 128) blocks when that is ≥ 1), so prompts sharing their first j ids "
    "share their first ⌊j/k⌋ scaled blocks and no more; a partial tail becomes ⌈tail × factor⌉ unique "
    "tokens; prompts are capped at --max-prompt-tokens (a prefix); max_tokens = round(output × factor), "
    "at most --max-tokens; the first --max-requests requests; arrival times × --time-scale (default: "
    "the factor that fits them into --duration seconds, never above 1). The simulator runs on exactly "
    "these requests, at the times they were sent; the JSON's `scaling` says what was used.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.bench.replay_cluster import LAUNCHERS
    from kvledger.bench.workloads import WORKLOADS

    p.description = HELP + ". " + SCALING_HELP
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace")
    src.add_argument("--workload", choices=WORKLOADS, help="a generated workload")
    p.add_argument("--sessions", type=int, help=f"workload sessions (default {SESSIONS})")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--url", help="a running server or cluster (default: start a local one per policy)")
    p.add_argument("--routing", nargs="+", choices=POLICIES, default=["cache-aware"], metavar="POLICY",
                   help=f"one or more of {', '.join(POLICIES)}; with --url, the one the server runs")
    p.add_argument("--launcher", choices=LAUNCHERS, default="up",
                   help="the local server: a cluster (kvledger up) or one kvledger serve")
    p.add_argument("--prefill", type=int, default=2, help="prefill engines (of the local cluster, and the sim's)")
    p.add_argument("--decode", type=int, default=1, help="decode engines (of the local cluster, and the sim's)")
    from kvledger.engine.models import registry

    p.add_argument("--model", default=registry.DEFAULT_MODEL, choices=registry.TEXT_MODELS,
                   help="the server's model (one with a tokenizer: the replay sends text)")
    p.add_argument("--api-key", help="bearer key for --url")
    p.add_argument("--length-scale", type=float, default=0.25, help="factor on every length (see above)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="context cap (rounded down to 128s)")
    p.add_argument("--max-tokens", type=int, default=4, help="cap on generated tokens per request")
    p.add_argument("--max-requests", type=int, default=200, help="the first N requests by arrival")
    p.add_argument("--duration", type=float, default=240.0, help="seconds the arrivals are compressed into")
    p.add_argument("--time-scale", type=float, help="factor on arrival times (instead of --duration)")
    p.add_argument("--max-inflight", type=int, default=16,
                   help="requests in flight at once (kvledger serve/up allow 16 per key by default)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--probe-tokens", type=int, default=1024,
                   help="long calibration probe (vs 128 tokens) for the prefill rate; 0: no probes (rate assumed)")


def _check_args(args: argparse.Namespace) -> None:
    from kvledger.util.output import CliError

    for name in ("prefill", "decode", "max_tokens", "max_requests", "max_inflight"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if args.sessions is not None and args.sessions < 1:
        raise CliError("--sessions must be >= 1")
    if args.max_prompt_tokens < 128:
        raise CliError("--max-prompt-tokens must be >= 128")
    if args.probe_tokens and not 256 <= args.probe_tokens <= 4096:
        raise CliError("--probe-tokens must be 0 or lie in [256, 4096]")
    for name in ("length_scale", "duration", "timeout", "time_scale"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0")
    if args.length_scale > 16:
        raise CliError("--length-scale must be <= 16")
    if args.url and len(args.routing) > 1:
        raise CliError("--url runs one policy (the server's): give one --routing")
    if args.url:
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(args.url)
            ok = parts.scheme == "http" and bool(parts.hostname) and parts.path in ("", "/") and parts.port != 0
        except ValueError:
            ok = False
        if not ok:
            raise CliError(f"--url {args.url}: expected http://HOST:PORT")


def load(args: argparse.Namespace) -> Trace:
    """The source trace (a file or a generated workload); CliError with one line when unreadable."""
    from kvledger.bench.trace import TraceError, read_trace
    from kvledger.bench.workloads import generate
    from kvledger.util.output import CliError

    try:
        if args.workload:
            return generate(args.workload, args.seed, args.sessions or SESSIONS[args.workload])
        return read_trace(args.trace)
    except TraceError as e:
        raise CliError(str(e)) from None
    except ValueError as e:
        raise CliError(f"--{e}") from None


def scaled(args: argparse.Namespace) -> tuple[Trace, Scaling, list[ScaledRequest]]:
    from kvledger.bench.replay_scale import make_scaling, scale_trace
    from kvledger.util.output import CliError

    trace = load(args)
    try:
        scaling = make_scaling(trace, args.length_scale, args.max_prompt_tokens, args.max_tokens,
                               args.max_requests, args.duration, args.time_scale)
    except ValueError as e:
        raise CliError(f"{trace.source}: {e}") from None
    return trace, scaling, scale_trace(trace, scaling)


def run_policy(args: argparse.Namespace, policy: str, requests: list, root: Path) -> dict[str, Any]:
    """One policy: start its server (unless --url), calibrate, replay, report."""
    from contextlib import nullcontext

    from kvledger.bench.replay_cluster import LocalServer

    if args.url:
        ctx, engines, server = nullcontext(None), (args.prefill, args.decode), f"--url {args.url}"
    else:
        ctx = LocalServer(args.launcher, root, policy, args.prefill, args.decode, args.model)
        engines, server = ctx.engines, ctx.description
    with ctx as local:
        url = args.url.rstrip("/") if args.url else local.url
        return measure(args, policy, requests, url, engines, server)


def measure(args: argparse.Namespace, policy: str, requests: list, url: str, engines: tuple[int, int],
            server: str) -> dict[str, Any]:
    from kvledger.bench import replay_drive as drive
    from kvledger.bench.replay_progress import progress
    from kvledger.bench.replay_report import policy_report
    from kvledger.core import ModelSpec

    if not drive.reachable(url, args.api_key):
        from kvledger.util.output import CliError

        raise CliError(f"{url}: no answer from /health")
    target = drive.Target(url, args.model, f"replay-{secrets.token_hex(6)}", args.api_key, args.timeout)
    tps, pairs = drive.calibrate_prefill(target, args.probe_tokens)
    before = drive.fetch_seconds(url, args.api_key)
    with progress(len(requests), policy) as on_done:
        outcomes, wall, late = drive.drive(target, requests, args.max_inflight, on_done)
    after = drive.fetch_seconds(url, args.api_key)
    spec = ModelSpec.preset(args.model)

    def nbytes(tokens: int) -> int:
        return tokens // spec.block_size * spec.block_bytes()

    ok = [o for o in outcomes if o.ok]
    cal = drive.Calibration(tps, (drive.CAL_SHORT, args.probe_tokens), pairs,
                            after - before if before is not None and after is not None else None,
                            sum(nbytes(o.cached_tokens) for o in ok), sum(nbytes(o.store_cached_tokens) for o in ok))
    report = policy_report(policy, server, outcomes, wall, late, requests, cal, engines, args.model)
    report["outcomes"] = outcomes
    return report


def run(args: argparse.Namespace) -> None:
    from kvledger.bench.replay_output import emit

    _check_args(args)
    trace, scaling, requests = scaled(args)
    if args.out:
        from kvledger.util.output import CliError

        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"--out {args.out}: {e.strerror or e}") from None
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-replay-") as tmp:
        runs = [run_policy(args, policy, requests, Path(tmp)) for policy in args.routing]
    emit(args, trace.source, scaling, requests, runs)
