"""`kvledger bench pd`: a P/D cluster's decode leg with the prompt's tail handed over by the prefill engine, and
with it recomputed (`--no-tail-handoff`), side by side in one run.

Each side is `kvledger up` with one prefill and one decode engine. `--requests` prompts of `--tokens` token
ids each (random, so no two share a block) are streamed one after the other, greedy, `max_tokens` 4. Per
request:
- the TTFT: the prefill leg;
- the decode leg's start: the time from the first token to the second. It is what the decode leg's CHECK, its
  block fetch, the tail (pulled or recomputed) and its first step take;
- the prompt tokens the decode leg ran through the model, from its usage.

Figures are medians with their spread (min–max). The sides alternate per round (handoff, then recompute), each
round on fresh prompts, so slow drift of the machine falls on both. The replies of the two sides must be
equal.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.bench.record import spread
from kvledger.util.output import CliError, emit_json

HELP = "P/D decode leg: the prompt's tail handed over by the prefill engine vs recomputed"
EXAMPLES = ("kvledger bench pd --json --record docs/results", "kvledger bench pd --tokens 2000 --requests 7",
            "kvledger bench pd --model gemma3-270m --requests 7")
SIDES = {"handoff": (), "recompute": ("--no-tail-handoff",)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.add_argument("--tokens", type=int, default=1000, help="prompt length in tokens; it should end inside a block "
                   "(default %(default)s: 7 blocks and a tail of 104)")
    p.add_argument("--requests", type=int, default=5, help="prompts per side (default %(default)s)")
    p.add_argument("--dir", default=None, help="where the clusters' data goes (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    from kvledger.core import takes_tail
    from kvledger.engine.models.registry import resolve

    try:
        spec = resolve(args.model).spec
    except ValueError as e:
        raise CliError(str(e)) from None
    if not 2 <= args.tokens <= 30_000 or not 1 <= args.requests <= 100:
        raise CliError("--tokens must lie in [2, 30000] and --requests in [1, 100]")
    if not takes_tail(spec):
        raise CliError(f"{spec.name}'s decode leg computes its last {spec.reserve_tokens} prompt tokens whatever it is "
                       "handed (its snapshots drop some windows): the tail hand-off is for models whose snapshots keep "
                       "them all (full attention, Gemma 3)")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40_000, args.tokens).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = _measure(Path(tmp), args.model, prompts)
    result = _summary(args, spec.block_size, rows)
    if args.json:
        emit_json(result)
    else:
        _print_table(result)
    return 0


def _measure(tmp: Path, model: str, prompts: list[list[int]]) -> dict[str, list[dict[str, Any]]]:
    """Both sides' clusters up at once (each engine its own process), the requests alternating between them."""
    from kvledger.entrypoint.cluster_process import ClusterProcess

    clusters = {side: ClusterProcess(tmp / side, *flags, prefill=1, decode=1, model=model)
                for side, flags in SIDES.items()}
    rows: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    try:
        for c in clusters.values():
            c.start()
        for c in clusters.values():   # a warm-up request each: first-call costs are not the figure
            _one(c.url, model, [7] * 300)
        for prompt in prompts:
            for side, c in clusters.items():
                rows[side].append(_one(c.url, model, prompt))
    finally:
        for c in clusters.values():
            c.stop()
    return rows


def _one(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed request: TTFT, the gap to the second token, the decode leg's counts, the tokens."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    start, times, tokens, usage = time.perf_counter(), [], [], None
    for part in client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if part.choices and part.choices[0].text is not None:
            times.append(time.perf_counter() - start)
            tokens.append(part.choices[0].text)
        usage = part.usage or usage
    legs = usage.model_dump()["kvledger"]["legs"] if usage is not None else []
    decode = next((leg for leg in legs if leg["kind"] == "decode"), None)
    if len(times) < 2 or decode is None:
        raise CliError(f"a request did not run as a prefill leg and a decode leg: legs {legs}")
    return {"ttft_s": times[0], "decode_start_s": times[1] - times[0], "text": "".join(tokens),
            "decode_cached_tokens": decode["cached_tokens"], "decode_computed_tokens": decode["computed_prompt_tokens"]}



def _summary(args: argparse.Namespace, block: int, rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    from kvledger.engine.threads import threads_per_process   # what `kvledger up` gave each of its 2 engines

    sides = {side: {"ttft_s": spread([r["ttft_s"] for r in rs]),
                    "decode_start_s": spread([r["decode_start_s"] for r in rs]),
                    "decode_computed_tokens": sorted({r["decode_computed_tokens"] for r in rs}),
                    "decode_cached_tokens": sorted({r["decode_cached_tokens"] for r in rs})}
             for side, rs in rows.items()}
    ratio = sides["handoff"]["decode_start_s"]["median"] / sides["recompute"]["decode_start_s"]["median"]
    same = [a["text"] == b["text"] for a, b in zip(rows["handoff"], rows["recompute"])]
    return {"model": args.model, "tokens": args.tokens, "tail_tokens": args.tokens % block, "requests": args.requests,
            "threads_per_engine": threads_per_process(None, 2), "sides": sides,
            "decode_start_ratio": round(ratio, 4), "replies_equal": all(same)}


def _print_table(r: dict[str, Any]) -> None:
    print(f"{r['model']}, {r['tokens']}-token prompts (tail {r['tail_tokens']}), {r['requests']} requests per side")
    print(f"{'side':<10} {'TTFT s':>22} {'decode leg start s':>22} {'decode computed':>16}")
    for side, s in r["sides"].items():
        t, d = s["ttft_s"], s["decode_start_s"]
        print(f"{side:<10} {t['median']:>8.3f} ({t['min']:.3f}–{t['max']:.3f}) "
              f"{d['median']:>8.3f} ({d['min']:.3f}–{d['max']:.3f}) {s['decode_computed_tokens']!s:>16}")
    print(f"decode leg start, handoff / recompute: {r['decode_start_ratio']}; replies equal: {r['replies_equal']}")
