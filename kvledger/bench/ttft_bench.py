"""`kvledger bench ttft`: time to first token of one prompt cold, on a full hit, and on a bounded-replay hit.

In one run, on one engine and a fresh embedded block ledger (plus a state ledger for windowed
models): the prompt (N deterministic pseudo-random token ids) is prefilled cold and decoded for
32 greedy tokens; the device prefix cache is emptied; the same prompt runs again on a full hit
(blocks fetched by the fetcher process and swapped in layer by layer; for a windowed model the
snapshot at L1 too), then on a hit with bounded replay (the snapshot withheld). Each TTFT counts
from the start of CHECK to the first token and is split into CHECK, fetch, swap-in and compute.

`overlap_fraction` is the share of fetch + swap-in that compute hid: (swap-in copy time − time the
forward waited for it) / (fetch + swap-in copy time). The fetch itself is never hidden here (a
single request has nothing else to compute while its blocks arrive), so the fraction is at most
swap-in's share. A model without sliding-window layers has no replay: its replay run is the
full hit again and `replay_note` says so.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np

HELP = "engine TTFT: cold vs full hit vs bounded replay, split into CHECK, fetch, swap-in, compute"
EXAMPLES = ("kvledger bench ttft --tokens 4096 --json",)  # `--help`'s epilog
GREEDY_TOKENS = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default %(default)s: a loaded machine spins on more)")
    p.add_argument("--data-dir", help="block ledger folder (default: a fresh temporary one)")


def _prompt(n: int, vocab: int) -> list[int]:
    return np.random.default_rng(1234).integers(100, min(vocab, 40000), n).tolist()


def _run(engine: Any, ledger: Any, states: Any, tokens: list[int], rid: str, *, replay: bool) -> dict[str, Any]:
    """CHECK + generate GREEDY_TOKENS greedy tokens; the first-token split, the tokens, the decision."""
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.entrypoint.check import check_prompt

    t0 = time.perf_counter()
    keys, decision = check_prompt(tokens, engine.spec, block_ledger=ledger, state_ledger=states, replay=replay)
    check_s = time.perf_counter() - t0
    engine.add_request(EngineRequest(rid, tokens, keys, decision,
                                     SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)))
    out: list[int] = []
    ttft = None
    usage = None
    while engine.has_unfinished():
        for event in engine.step():
            if ttft is None and event.token_ids:
                ttft = time.perf_counter() - t0
                usage = event.usage
            out += event.token_ids
    engine.wait_stored()
    engine.check_integrity()
    t = usage.timings
    split = {"check_s": check_s, "fetch_s": t.get("fetch_s", 0.0), "swapin_s": t.get("swapin_s", 0.0),
             "swapin_wait_s": t.get("swapin_wait_s", 0.0), "compute_s": t.get("compute_s", 0.0), "ttft_s": ttft}
    return {"split": split, "tokens": out, "decision": decision.kind.value, "hit_kind": usage.hit_kind,
            "cached_tokens": usage.cached_tokens, "logits": engine.first_logits.pop(rid)}


def _overlap(split: dict[str, float]) -> float:
    moved = split["fetch_s"] + split["swapin_s"]
    hidden = max(split["swapin_s"] - split["swapin_wait_s"], 0.0)
    return hidden / moved if moved > 0 else 0.0


def measure(model: str, tokens: int, device: str, data_dir: str) -> dict[str, Any]:
    from kvledger.engine.engine import Engine
    from kvledger.engine.models.registry import resolve
    from kvledger.store.ledger import BlockLedger

    entry = resolve(model)
    spec = entry.spec
    ledger = BlockLedger.open(path=data_dir)
    states = None
    if spec.has_swa:
        from kvledger.state.ledger import StateLedger

        states = StateLedger(spec, token="bench-ttft", serve=False, heartbeat=False).start()
    engine = Engine(entry, block_ledger=ledger, state_ledger=states, device=device, max_num_seqs=1,
                    max_num_batched_tokens=tokens, replay=True)
    engine.record_logits = True
    try:
        prompt = _prompt(tokens, engine.model.vocab_size)
        cold = _run(engine, ledger, states, prompt, "cold", replay=False)
        engine.clear_device_cache()
        hit = _run(engine, ledger, states, prompt, "hit", replay=False)
        engine.clear_device_cache()
        replay = _run(engine, ledger, None, prompt, "replay", replay=True) if spec.has_swa else hit
    finally:
        engine.close()
        if states is not None:
            states.close()
        ledger.close()
    return _report(model, tokens, device, cold, hit, replay, spec.has_swa)


def _report(model: str, tokens: int, device: str, cold: dict, hit: dict, replay: dict, windowed: bool) -> dict:
    ref = cold["logits"]

    def rel(run: dict) -> float:
        return float((run["logits"] - ref).abs().max() / ref.abs().max())

    out = {
        "model": model, "tokens": tokens, "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ttft_cold_s": cold["split"]["ttft_s"], "ttft_hit_s": hit["split"]["ttft_s"],
        "ttft_replay_s": replay["split"]["ttft_s"],
        "hit_over_cold": hit["split"]["ttft_s"] / cold["split"]["ttft_s"],
        "replay_over_cold": replay["split"]["ttft_s"] / cold["split"]["ttft_s"],
        "overlap_fraction": _overlap(hit["split"]),
        "swapin_hidden_fraction": (max(hit["split"]["swapin_s"] - hit["split"]["swapin_wait_s"], 0.0)
                                   / hit["split"]["swapin_s"]) if hit["split"]["swapin_s"] else 0.0,
        "hit_logits_max_rel_err": rel(hit), "replay_logits_max_rel_err": rel(replay),
        "greedy_match": hit["tokens"] == cold["tokens"], "replay_greedy_match": replay["tokens"] == cold["tokens"],
        "greedy_tokens": GREEDY_TOKENS,
        "hit_kind": hit["hit_kind"], "replay_hit_kind": replay["hit_kind"],
        "cached_tokens_hit": hit["cached_tokens"], "cached_tokens_replay": replay["cached_tokens"],
        "cold": cold["split"], "hit": hit["split"], "replay": replay["split"],
    }
    if not windowed:
        out["replay_note"] = "no sliding-window layers: a bounded replay is the full hit (same run reported)"
    return out


def run(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    import torch

    from kvledger.engine.models.registry import cli_resolve
    from kvledger.util.output import CliError, emit_json

    cli_resolve(args.model)
    if args.tokens < 2 * 128:
        raise CliError("--tokens must be at least 256 (a hit needs a whole block before the cap)")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvledger-ttft-") as tmp:
        result = measure(args.model, args.tokens, args.device, args.data_dir or tmp)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ttft.json").write_text(json.dumps(result, indent=2))
    if args.json:
        emit_json(result)
        return
    _print_table(result)


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"TTFT, {r['model']}, {r['tokens']} tokens, {r['device']}")
    for col in ("run", "TTFT s", "CHECK s", "fetch s", "swap-in s", "(waited) s", "compute s"):
        table.add_column(col, justify="right")
    for name in ("cold", "hit", "replay"):
        s = r[name]
        table.add_row(name, *(f"{s[k]:.3f}" for k in ("ttft_s", "check_s", "fetch_s", "swapin_s", "swapin_wait_s",
                                                       "compute_s")))
    console = Console()
    console.print(table)
    console.print(f"hit/cold {r['hit_over_cold']:.3f}  overlap {r['overlap_fraction']:.2f}  "
                  f"rel err {r['hit_logits_max_rel_err']:.2e}  greedy match {r['greedy_match']}  "
                  f"hit kind {r['hit_kind']}")
