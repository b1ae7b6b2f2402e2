"""`kvledger bench accuracy`: over many prompts of real text, does each kind of hit answer as cold does?

The prompts are `--prompts` windows of `--tokens` tokens of real English prose and code: the Python Language
Reference's topics as the standard library ships them (`pydoc_data.topics`), concatenated in name order and
cut into consecutive windows, each preceded by the model's `<bos>` (none of the tests' prompts). For each,
on one engine and a fresh embedded ledger: a cold prefill that stores its blocks and snapshots (rule 4′,
a checkpoint every `--period` tokens), then each hit kind of `kvledger bench ttft` (hit at L1, the periodic
checkpoint's exact resume, the truncated-window fallback, bounded replay), the device cache emptied before
each. Every run generates `--greedy` greedy tokens. Reported per kind, against the cold run of the same
prompt: how many prompts give the same greedy tokens, how many tokens agree before the first that differs
(median, min), and the first token's max relative logit error (median, max).

This is what decides whether the truncated-window fallback may be on for a model (DESIGN rule 3′): an exact
kind should agree on every prompt, within float rounding; a truncated one is measured, not assumed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

HELP = "greedy agreement and logit error of each hit kind against cold, over many prompts of real text"
EXAMPLES = ("kvledger bench accuracy --model gemma3-270m --prompts 50 --record docs/results",)
HIT_KINDS = ("hit", "periodic", "fallback", "replay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.bench.engine_cli import add_period_arg, add_threads_arg
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.add_argument("--prompts", type=int, default=50, help="prompts of real text (default %(default)s)")
    p.add_argument("--tokens", type=int, default=1200, help="tokens per prompt, <bos> included (default %(default)s)")
    add_period_arg(p)
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens per run (default %(default)s)")
    add_threads_arg(p)


def reference_texts(tokenizer: Any, n: int, tokens: int, bos: int | None) -> list[list[int]]:
    """`n` consecutive windows of `tokens` token ids (each starting with `bos` when given) of the Python
    Language Reference's topics; ValueError when the text is too short for them."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    body = tokens - (bos is not None)
    if n * body > len(ids):
        raise ValueError(f"the reference text has {len(ids)} tokens: not {n} prompts of {tokens}")
    head = [bos] if bos is not None else []
    return [head + ids[i * body:(i + 1) * body] for i in range(n)]


def _agreed(a: list[int], b: list[int]) -> int:
    """Leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(model: str, prompts: int, tokens: int, period: int, greedy: int, data_dir: str) -> dict[str, Any]:
    from kvledger.bench.ttft_bench import _run
    from kvledger.engine.engine import Engine
    from kvledger.engine.models.registry import resolve
    from kvledger.state.ledger import StateLedger
    from kvledger.store.ledger import BlockLedger

    entry = resolve(model)
    spec = entry.spec
    if not spec.has_swa:
        raise ValueError(f"{model} has no sliding-window layers: its only hit kind is exact by construction")
    tokenizer = entry.tokenizer()
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: its prompts cannot be real text")
    bos = tokenizer.token_to_id("<bos>")
    texts = reference_texts(tokenizer, prompts, tokens, bos)
    rows: dict[str, list[dict]] = {k: [] for k in HIT_KINDS}
    started = time.perf_counter()
    with BlockLedger.open(path=data_dir) as ledger, StateLedger(
            spec, token="bench-accuracy", serve=False, heartbeat=False, capacity_bytes=1 << 30) as states:
        engine = Engine(entry, block_ledger=ledger, state_ledger=states, max_num_seqs=1,
                        max_num_batched_tokens=tokens, checkpoint_every=period)
        engine.record_logits = True
        try:
            for i, prompt in enumerate(texts):
                ns = f"prompt-{i}"
                engine.checkpoint_every = period
                cold = _run(engine, ledger, states, prompt, f"{ns}-cold", "stored", ns, greedy)
                engine.checkpoint_every = 0
                for kind in HIT_KINDS:
                    engine.clear_device_cache()
                    r = _run(engine, ledger, states, prompt, f"{ns}-{kind}", kind, ns, greedy)
                    err = float((r["logits"] - cold["logits"]).abs().max() / cold["logits"].abs().max())
                    rows[kind].append({"hit_kind": r["hit_kind"], "cached": r["cached_tokens"],
                                       "agreed": _agreed(r["tokens"], cold["tokens"]), "rel_err": err})
        finally:
            engine.close()
    return _report(model, prompts, tokens, period, greedy, rows, time.perf_counter() - started)


def _report(model: str, prompts: int, tokens: int, period: int, greedy: int, rows: dict[str, list[dict]],
            wall_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompts": prompts, "tokens": tokens, "period": period, "greedy": greedy,
                           "text": "pydoc_data.topics (the Python Language Reference), consecutive windows",
                           "wall_s": wall_s, "kinds": {}}
    for kind, rs in rows.items():
        agreed, errs = [r["agreed"] for r in rs], [r["rel_err"] for r in rs]
        out["kinds"][kind] = {
            "hit_kinds": sorted({r["hit_kind"] for r in rs}),
            "greedy_equal": sum(a == greedy for a in agreed), "agreed_median": statistics.median(agreed),
            "agreed_min": min(agreed), "rel_err_median": statistics.median(errs), "rel_err_max": max(errs),
            "cached_median": statistics.median(r["cached"] for r in rs),
        }
    return out


def run(args: argparse.Namespace) -> None:
    from kvledger.bench.engine_cli import check_period, run_measure
    from kvledger.engine.models.registry import cli_resolve
    from kvledger.util.output import CliError

    cli_resolve(args.model)
    if args.prompts < 1 or args.greedy < 1 or args.tokens < 256:
        raise CliError("--prompts and --greedy must be at least 1, --tokens at least 256")
    check_period(args.period)

    def measured() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="kvledger-accuracy-") as tmp:
            return measure(args.model, args.prompts, args.tokens, args.period, args.greedy, tmp)

    run_measure(args, measured, _print_table)


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{r['model']}: {r['prompts']} prompts of {r['tokens']} tokens of real text, "
                        f"{r['greedy']} greedy tokens, checkpoints every {r['period']}")
    for col in ("kind", "greedy = cold", "agreed (median, min)", "rel err (median, max)", "cached (median)"):
        table.add_column(col, justify="right")
    for kind, k in r["kinds"].items():
        table.add_row(kind, f"{k['greedy_equal']}/{r['prompts']}", f"{k['agreed_median']:g}, {k['agreed_min']}",
                      f"{k['rel_err_median']:.1e}, {k['rel_err_max']:.1e}", f"{k['cached_median']:g}")
    Console().print(table)
