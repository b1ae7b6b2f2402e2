"""`kvledger bench rag`: one long shared document, many different questions after it, by snapshot strategy.

The RAG shape that rule 4′'s periodic checkpointing is for. The document is `--doc-tokens` tokens of real
text (`hit_accuracy.reference_texts`: the Python Language Reference), each question `--question-tokens`
tokens of other text after it; the questions' blocks match up to the document's last whole block, never to
an earlier prompt's end, so a snapshot stored at a prompt's own end (rule 4) never serves the next question.
Each strategy runs the same prompts on a fresh embedded ledger, the device cache emptied before each question:

    | strategy        | snapshots a prefill takes                 | the next question resumes            |
    |-----------------|-------------------------------------------|--------------------------------------|
    | prefill         | rule 4′'s c and p only                    | nowhere (a miss): no snapshot in doc |
    | shared          | also rule 4″'s branch point (the serving  | the second question keeps the window |
    |                 | default: `core.shared_prefix_positions`)  | at L1; from the third, exactly there |
    | periodic:P      | also every P tokens (`checkpoint_positions`)| exactly at the latest k·P ≤ L1     |
    | zero            | none (the state ledger keeps nothing)     | nowhere (a miss)                     |

Reported per strategy, over the questions after the first: prompt tokens reused (hit) and computed, the
median TTFT with its spread; and at the end the bytes kept: the block ledger's files, the snapshots in host
memory, and their sum per stored token against a store that keeps every layer's KV per block (what a
connector without a state ledger stores: every layer's K and V of every token, from the spec).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "a shared document and many questions: hit and recomputed tokens, TTFT and bytes kept, per strategy"
EXAMPLES = ("kvledger bench rag --model gemma3-270m --record docs/results",)
STRATEGIES = ("prefill", "shared", "periodic:512", "periodic:1024", "periodic:2048", "zero")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.bench.engine_cli import add_threads_arg
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.set_defaults(model="gemma3-270m")
    p.add_argument("--doc-tokens", type=int, default=4000, help="document tokens, <bos> included (default "
                   "%(default)s)")
    p.add_argument("--questions", type=int, default=6, help="questions after it (default %(default)s)")
    p.add_argument("--question-tokens", type=int, default=160, help="tokens per question (default %(default)s)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default %(default)s)")
    add_threads_arg(p)


def _one_strategy(entry: Any, strategy: str, doc: list[int], questions: list[list[int]], root: Path
                  ) -> dict[str, Any]:
    from kvledger.engine.engine import Engine
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.core import shared_prefix_positions
    from kvledger.entrypoint.check import check_prompt_explained
    from kvledger.state.ledger import StateLedger
    from kvledger.store.ledger import BlockLedger

    spec = entry.spec
    every = int(strategy.partition(":")[2] or 0)
    keeps = strategy != "zero"
    runs = []
    with BlockLedger.open(path=root / "blocks") as ledger, StateLedger(
            spec, token="bench-rag", serve=False, heartbeat=False, capacity_bytes=(2 << 30) if keeps else 0,
            strategy="memory" if keeps else "zero") as states:
        engine = Engine(entry, block_ledger=ledger, state_ledger=states, max_num_seqs=1,
                        max_num_batched_tokens=4096, checkpoint_every=every)
        try:
            for i, question in enumerate(questions):
                engine.clear_device_cache()
                tokens = doc + question
                t0 = time.perf_counter()
                keys, lookup, _ = check_prompt_explained(tokens, spec, block_ledger=ledger, state_ledger=states)
                decision = lookup.decision
                shared = shared_prefix_positions(lookup, spec) if strategy == "shared" else ()
                engine.add_request(EngineRequest(f"q{i}", tokens, keys, decision,
                                                 SamplingParams(max_tokens=1, ignore_eos=True), snapshot_at=shared))
                usage = None
                while engine.has_unfinished():
                    for event in engine.step():
                        usage = event.usage or usage
                ttft = time.perf_counter() - t0
                engine.wait_stored()
                runs.append({"prompt": len(tokens), "cached": usage.cached_tokens,
                             "computed": len(tokens) - decision.recompute_from, "hit_kind": usage.hit_kind,
                             "ttft_s": ttft})
        finally:
            engine.close()
        stats = ledger.stats()
        snapshots = len(states.pool) if states.pool is not None else 0
    later = runs[1:]
    ttfts = [r["ttft_s"] for r in later]
    snapshot_bytes = snapshots * spec.state_size_to_disk()
    stored_tokens = stats.blocks * spec.block_size
    kept = stats.disk_bytes + snapshot_bytes
    return {
        "strategy": strategy, "questions": len(later), "hit_tokens": sum(r["cached"] for r in later),
        "computed_tokens": sum(r["computed"] for r in later), "prompt_tokens": sum(r["prompt"] for r in later),
        "hit_kinds": sorted({r["hit_kind"] for r in later}),
        "ttft_s": statistics.median(ttfts), "ttft_spread_s": [min(ttfts), max(ttfts)],
        "first_ttft_s": runs[0]["ttft_s"],
        "snapshots": snapshots, "snapshot_bytes": snapshot_bytes, "block_disk_bytes": stats.disk_bytes,
        "stored_tokens": stored_tokens, "bytes_per_stored_token": kept / stored_tokens if stored_tokens else None,
        "all_layers_bytes_per_token": spec.all_layers_bytes_per_token(),
        "vs_all_layers": kept / (stored_tokens * spec.all_layers_bytes_per_token()) if stored_tokens else None,
        "runs": runs,
    }


def measure(model: str, doc_tokens: int, questions: int, question_tokens: int, strategies: list[str]
            ) -> dict[str, Any]:
    from kvledger.bench.hit_accuracy import reference_texts
    from kvledger.engine.models.registry import resolve

    entry = resolve(model)
    if not entry.spec.has_swa:
        raise ValueError(f"{model} has no sliding-window layers: a hit needs no snapshot, every strategy is one")
    tokenizer = entry.tokenizer()
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer: its document cannot be real text")
    doc = reference_texts(tokenizer, 1, doc_tokens, tokenizer.token_to_id("<bos>"))[0]
    rest = reference_texts(tokenizer, questions + doc_tokens // question_tokens + 1, question_tokens, None)
    asked = rest[doc_tokens // question_tokens + 1:]   # past the document's own text
    out: dict[str, Any] = {"model": model, "doc_tokens": len(doc), "questions": questions,
                           "question_tokens": question_tokens,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "strategies": []}
    for strategy in strategies:
        with tempfile.TemporaryDirectory(prefix="kvledger-rag-") as tmp:
            out["strategies"].append(_one_strategy(entry, strategy, doc, asked, Path(tmp)))
    return out


def _parse(text: str, block: int) -> list[str]:
    from kvledger.util.output import CliError

    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names:
        name, _, n = s.partition(":")
        periodic = name == "periodic" and n.isdigit() and int(n) > 0 and int(n) % block == 0
        ok = s in ("prefill", "shared", "zero") or periodic
        if not ok:
            raise CliError(f"--strategies: {s!r} is not prefill, shared, zero or periodic:N (N a multiple of "
                           f"{block})")
    if not names:
        raise CliError("--strategies: name at least one")
    return names


def run(args: argparse.Namespace) -> None:
    from kvledger.bench.engine_cli import run_measure
    from kvledger.engine.models.registry import cli_resolve
    from kvledger.util.output import CliError

    entry = cli_resolve(args.model)
    strategies = _parse(args.strategies, entry.spec.block_size)
    if args.questions < 2 or args.question_tokens < 1 or args.doc_tokens < 2 * entry.spec.block_size:
        raise CliError("--questions must be at least 2, --question-tokens at least 1, --doc-tokens at least 256")
    run_measure(args, lambda: measure(args.model, args.doc_tokens, args.questions, args.question_tokens,
                                      strategies), _print_table)


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{r['model']}: a {r['doc_tokens']}-token document, then {r['questions']} questions of "
                        f"{r['question_tokens']} tokens (the figures: questions 2..{r['questions']})")
    for col in ("strategy", "hit tok", "computed tok", "TTFT s (spread)", "snapshots", "snapshot MiB",
                "block MiB", "B / stored token", "× all-layers"):
        table.add_column(col, justify="right")
    for s in r["strategies"]:
        lo, hi = s["ttft_spread_s"]
        table.add_row(s["strategy"], str(s["hit_tokens"]), str(s["computed_tokens"]),
                      f"{s['ttft_s']:.2f} ({lo:.2f}–{hi:.2f})", str(s["snapshots"]),
                      f"{s['snapshot_bytes'] / 2**20:.1f}", f"{s['block_disk_bytes'] / 2**20:.1f}",
                      f"{s['bytes_per_stored_token']:,.0f}", f"{s['vs_all_layers']:.2f}")
    Console().print(table)
