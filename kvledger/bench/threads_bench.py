"""`kvledger bench threads`: `kvledger serve`'s TTFT and TPOT at each torch thread count, on a quiet machine and
with other processes keeping cores busy, side by side in one run: the measurement behind `--threads`'s default.

For each load (`--burners`: 0, then each count given; a burner is a process spinning on one core) and each
thread count (`--threads-list`, default 1, `--threads`'s default and the CPUs this process may use), a fresh
`kvledger serve --threads N` gets a warm-up request, then `--repeat` rounds of: a prompt of `--tokens` random
token ids no other round shares (cold), then the same prompt with 3 more tokens (a hit on its blocks), each
streaming `--output-tokens` greedy tokens. TTFT and TPOT are timed by the client; figures are medians with
their range (min–max).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.bench.record import spread
from kvledger.util.output import CliError, emit_json

HELP = "kvledger serve's TTFT and TPOT per torch thread count, quiet and with cores kept busy"
EXAMPLES = ("kvledger bench threads --json --record docs/results",
            "kvledger bench threads --model tiny-v4 --tokens 600 --burners 1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.add_argument("--tokens", type=int, default=2000, help="prompt length in tokens (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens per reply (default %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="cold + hit rounds per setting (default %(default)s)")
    p.add_argument("--threads-list", default=None, metavar="N,M",
                   help="thread counts to compare (default: 1, --threads's default and the CPUs this process may "
                        "run on)")
    p.add_argument("--burners", default="1", metavar="N,M",
                   help="besides a quiet machine, measure with this many processes spinning (default %(default)s; "
                        "'' for quiet only)")


def _counts(text: str | None, flag: str, minimum: int) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise CliError(f"{flag}: a comma-separated list of integers, got {text!r}") from None
    if any(c < minimum for c in counts):
        raise CliError(f"{flag}: every count must be >= {minimum}, got {text!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    from kvledger.engine.models.registry import resolve
    from kvledger.engine.threads import WAIT_SETTINGS, default_threads, usable_cpus

    try:
        resolve(args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    if not 16 <= args.tokens <= 30_000 or not 1 <= args.repeat <= 50 or not 2 <= args.output_tokens <= 1024:
        raise CliError("--tokens must lie in [16, 30000], --repeat in [1, 50] and --output-tokens in [2, 1024]")
    cpus = usable_cpus()
    threads = _counts(args.threads_list, "--threads-list", 1) or sorted({1, default_threads(cpus), cpus})
    loads = [0, *_counts(args.burners, "--burners", 1)]
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for burners in loads:
            for n in threads:
                prompts = [rng.integers(100, 1000, args.tokens).tolist() for _ in range(args.repeat)]
                rows.append({"burners": burners, "threads": n,
                             **_measure(Path(tmp) / f"b{burners}-t{n}", args, n, burners, prompts)})
    result = {"model": args.model, "tokens": args.tokens, "output_tokens": args.output_tokens,
              "repeat": args.repeat, "usable_cpus": cpus, "rows": rows, "fastest": _fastest(rows),
              # how the servers' idle OpenMP workers waited (engine/threads.py `limit_spinning`; None: unset)
              "openmp_wait": {name: os.environ.get(name) for name in WAIT_SETTINGS}}
    if args.json:
        emit_json(result)
    else:
        _print_table(result)
    return 0


def _measure(data: Path, args: argparse.Namespace, threads: int, burners: int,
             prompts: list[list[int]]) -> dict[str, Any]:
    from kvledger.bench.serve_client import stream_completion
    from kvledger.util.cpu_load import LoadSampler, burning
    from kvledger.util.serve_process import ServeProcess

    server = ServeProcess(data, "--threads", str(threads), "--no-trace", model=args.model).start()
    cold, hit, tpot = [], [], []
    try:
        stream_completion(server.url, args.model, list(range(100, 164)), 4)   # first-call costs are not the figure
        with burning(burners), LoadSampler() as load:
            for prompt in prompts:
                for kind, ids in (("cold", prompt), ("hit", prompt + [5, 6, 7])):
                    reply = stream_completion(server.url, args.model, ids, args.output_tokens)
                    (cold if kind == "cold" else hit).append(reply.ttft_s)
                    tpot.append((reply.latency_s - reply.ttft_s) / (args.output_tokens - 1))
                    if kind == "hit" and reply.cached_tokens == 0:
                        raise CliError(f"threads {threads}: the repeated prompt did not hit ({reply})")
    finally:
        server.stop()
    return {"cold_ttft_s": spread(cold), "hit_ttft_s": spread(hit), "tpot_s": spread(tpot),
            "load_1m": load.summary()}



def _fastest(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per load and figure, the thread count with the lowest median."""
    out: dict[str, dict[str, int]] = {}
    for burners in sorted({r["burners"] for r in rows}):
        at = [r for r in rows if r["burners"] == burners]
        out[f"burners_{burners}"] = {fig: min(at, key=lambda r: r[fig]["median"])["threads"]
                                     for fig in ("cold_ttft_s", "hit_ttft_s", "tpot_s")}
    return out


def _print_table(r: dict[str, Any]) -> None:
    print(f"{r['model']}, {r['tokens']}-token prompts, {r['output_tokens']} output tokens, {r['repeat']} rounds; "
          f"{r['usable_cpus']} usable CPUs")
    print(f"{'burners':>7} {'threads':>7} {'cold TTFT s':>24} {'hit TTFT s':>24} {'TPOT ms':>22} {'load':>6}")
    for row in r["rows"]:
        c, h, t = row["cold_ttft_s"], row["hit_ttft_s"], row["tpot_s"]
        print(f"{row['burners']:>7} {row['threads']:>7} {c['median']:>8.3f} ({c['min']:.3f}–{c['max']:.3f}) "
              f"{h['median']:>8.3f} ({h['min']:.3f}–{h['max']:.3f}) "
              f"{t['median'] * 1e3:>7.1f} ({t['min'] * 1e3:.1f}–{t['max'] * 1e3:.1f}) "
              f"{row['load_1m']['median'] or 0:>6.2f}")
    print(f"fastest thread count: {r['fastest']}")
