"""`kvledger bench preempt`: engine throughput with preemption by recompute vs reserving prompt + max_tokens
up front, on a device pool that the requests oversubscribe, side by side in one run.

N requests (deterministic pseudo-random prompts of `--prompt-tokens`, no shared prefix, `--max-tokens` greedy
tokens each, EOS ignored) arrive at once at one engine whose device pool holds 1/`--oversubscription` of the
blocks their prompt + max_tokens need together (never less than one request's). Each repeat runs both
policies, each on a fresh engine (no ledgers: the device pool and its prefix cache only), in alternating order:

    | policy  | admission reserves                     | when the pool runs out                           |
    |---------|----------------------------------------|--------------------------------------------------|
    | preempt | the prompt + the first decode step     | the newest running request is preempted (LIFO)   |
    |         |   (+ 1 spare block, windowed models)   |   and recomputed when readmitted (the default)   |
    | reserve | prompt + max_tokens (+ 1 spare)        | never: requests wait for admission instead       |

Reported per policy: output tokens per second (median over `--repeat`, and the spread: min, max), wall time,
steps, the mean running batch, preemptions and recomputed tokens per run; the ratio of the medians; whether
every request's greedy tokens were the same under both policies (they must be: a resume is exact); and the
load average (`os.getloadavg()`) before each repeat, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from kvledger.engine.defaults import DEFAULTS

HELP = "engine throughput, pool oversubscribed: preemption by recompute vs reserve up front, median and spread"
EXAMPLES = ("kvledger bench preempt --json",
            "kvledger bench preempt --model tiny-v4 --requests 8 --repeat 5 --threads 1 --record docs/results")
POLICIES = ("preempt", "reserve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.bench.engine_cli import add_threads_arg
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.set_defaults(model="tiny-v4")
    p.add_argument("--requests", type=int, default=8, help="requests, all arriving at once (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=192, help="prompt length in tokens (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="greedy tokens per request (default %(default)s)")
    p.add_argument("--oversubscription", type=float, default=2.0,
                   help="blocks the requests' prompt + max_tokens need together over the pool's (default "
                        "%(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs, help="the engine's running batch "
                   "limit (default %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each policy (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    add_threads_arg(p)


def _prompts(n: int, tokens: int, vocab: int) -> list[list[int]]:
    import numpy as np

    return [np.random.default_rng(1000 + i).integers(100, min(vocab, 32000), tokens).tolist() for i in range(n)]


def pool_blocks(spec: Any, requests: int, prompt_tokens: int, max_tokens: int, oversubscription: float) -> int:
    """The pool that `oversubscription` × its size would hold every request's prompt + max_tokens (loader's
    reserve-up-front count, spare included), never smaller than one request's."""
    one = -(-(prompt_tokens + max_tokens) // spec.block_size) + (1 if spec.has_swa else 0)
    return max(int(requests * one / oversubscription), one)


def _one_run(entry: Any, policy: str, prompts: list[list[int]], max_tokens: int, blocks: int, device: str,
             max_num_seqs: int) -> dict[str, Any]:
    """All requests through a fresh engine under `policy`; its figures and each request's tokens."""
    from kvledger.core import chain_keys, decide_hit
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.engine.engine import Engine

    engine = Engine(entry, block_ledger=None, fetcher="none", device=device, max_num_seqs=max_num_seqs,
                    kv_cache_bytes=(blocks + 1) * entry.spec.block_bytes(),
                    max_seq_tokens=len(prompts[0]) + max_tokens, preemption=policy == "preempt")
    tokens: dict[str, list[int]] = {}
    recomputed = steps = batch_total = 0
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", p, chain_keys(p, engine.spec), decide_hit(len(p), 0, set(),
                                             engine.spec), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        while engine.has_unfinished():
            batch_total += sum(1 for s in engine.scheduler.running)
            for ev in engine.step():
                tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.finished:
                    recomputed += ev.usage.recomputed_tokens
            steps += 1
        wall = time.perf_counter() - t0
        engine.check_integrity()
        out_tokens = sum(len(t) for t in tokens.values())
        return {"wall_s": wall, "tokens_per_s": out_tokens / wall, "output_tokens": out_tokens, "steps": steps,
                "mean_running": batch_total / steps, "preemptions": engine.preemptions,
                "recomputed_tokens": recomputed, "pool_blocks": engine.pool.total, "tokens": tokens}
    finally:
        engine.close()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens_per_s"] for r in runs]
    return {"n": len(runs), "tokens_per_s": statistics.median(rates),
            "tokens_per_s_spread": [min(rates), max(rates)],
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "steps": statistics.median(r["steps"] for r in runs),
            "mean_running": statistics.median(r["mean_running"] for r in runs),
            "preemptions": statistics.median(r["preemptions"] for r in runs),
            "recomputed_tokens": statistics.median(r["recomputed_tokens"] for r in runs),
            "per_run_tokens_per_s": [round(x, 1) for x in rates]}


def measure(model: str, requests: int, prompt_tokens: int, max_tokens: int, oversubscription: float, *,
            repeat: int, device: str = "cpu", max_num_seqs: int = DEFAULTS.max_num_seqs) -> dict[str, Any]:
    from kvledger.engine.models.registry import resolve

    entry = resolve(model)
    blocks = pool_blocks(entry.spec, requests, prompt_tokens, max_tokens, oversubscription)
    prompts = _prompts(requests, prompt_tokens, 32000)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    loads = []
    for k in range(repeat):
        loads.append([round(x, 2) for x in os.getloadavg()])
        for policy in (POLICIES if k % 2 == 0 else POLICIES[::-1]):
            runs[policy].append(_one_run(entry, policy, prompts, max_tokens, blocks, device, max_num_seqs))
    reference = runs["reserve"][0]["tokens"]
    same = all(r["tokens"] == reference for rs in runs.values() for r in rs)
    blocks = runs["reserve"][0]["pool_blocks"]   # the engine's (at least one request of the context it is given)
    summary = {p: _summary(rs) for p, rs in runs.items()}
    return {"model": model, "device": device, "requests": requests, "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "oversubscription": oversubscription, "pool_blocks": blocks,
            "max_num_seqs": max_num_seqs, "repeat": repeat, "runs": summary,
            "preempt_over_reserve": summary["preempt"]["tokens_per_s"] / summary["reserve"]["tokens_per_s"],
            "greedy_match": same, "load_avg_per_repeat": loads}


def run(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from kvledger.bench.engine_cli import run_measure
    from kvledger.engine.models.registry import cli_resolve
    from kvledger.util.output import CliError

    cli_resolve(args.model)
    if min(args.requests, args.prompt_tokens, args.max_tokens, args.repeat, args.max_num_seqs) < 1:
        raise CliError("--requests, --prompt-tokens, --max-tokens, --repeat and --max-num-seqs must be at least 1")
    if args.oversubscription < 1:
        raise CliError("--oversubscription must be at least 1")
    def measured() -> dict[str, Any]:
        result = measure(args.model, args.requests, args.prompt_tokens, args.max_tokens, args.oversubscription,
                         repeat=args.repeat, device=args.device, max_num_seqs=args.max_num_seqs)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "preempt.json").write_text(json.dumps(result, indent=2))
        return result

    run_measure(args, measured, _print_table)


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Throughput at {r['oversubscription']}× oversubscription, {r['model']}, {r['requests']} × "
                        f"({r['prompt_tokens']} + {r['max_tokens']}) tokens, pool {r['pool_blocks']} blocks "
                        f"(median of {r['repeat']})")
    for col in ("policy", "tokens/s", "spread", "wall s", "steps", "mean running", "preemptions", "recomputed"):
        table.add_column(col, justify="right")
    for name, s in r["runs"].items():
        lo, hi = s["tokens_per_s_spread"]
        table.add_row(name, f"{s['tokens_per_s']:.1f}", f"{lo:.1f}–{hi:.1f}", f"{s['wall_s']:.2f}",
                      f"{s['steps']:.0f}", f"{s['mean_running']:.2f}", f"{s['preemptions']:.0f}",
                      f"{s['recomputed_tokens']:.0f}")
    console = Console()
    console.print(table)
    console.print(f"preempt / reserve: {r['preempt_over_reserve']:.3f}; greedy tokens equal under both: "
                  f"{r['greedy_match']}; load average before each repeat: {r['load_avg_per_repeat']}")
