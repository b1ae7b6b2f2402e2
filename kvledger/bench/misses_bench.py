"""`kvledger bench misses`: what miss attribution costs the CHECK, and what its prompt sample holds at its cap.

The CHECK as the entrypoint runs it (chain keys hashed from a numpy token array, the index's answer,
`decide_hit`), with attribution off (`check_prompt`: `match`) and on (`check_prompt_explained`: the index's
`match_explained`, whose answer carries the first absent block's tombstone), interleaved rep by rep, at each
prompt length, on the embedded store (LMDB) and on Redis. Two prompts per length: one whose blocks are all
present (a hit), and one that diverges from a sampled prompt halfway (a miss: a block under the cap absent).
Beside it, the rest of a miss's attribution, which runs when the request is done, off the CHECK's path: the
first absent block's cause from the namespace's sample (`MissBook.first_absent`), as its own time. The sample
holds up to 32 prompts of the namespace (as many as its cap allows), the diverged one's original among them.

Memory: one namespace's sample filled to its cap (MAX_TOKENS tokens) with prompts of --sample-prompt-tokens,
measured by tracemalloc (everything the book allocated) beside `sample_bytes` (token ids and keys alone).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np

from kvledger.core import ModelSpec, chain_keys
from kvledger.entrypoint.check import check_prompt, check_prompt_explained
from kvledger.entrypoint.misses import MAX_TOKENS, MissBook
from kvledger.store.ledger import BlockLedger
from kvledger.util.output import CliError, emit_json

HELP = "miss attribution: the CHECK with it on against off, and the prompt sample's memory at its cap"
EXAMPLES = ("kvledger bench misses --json",)
NAMESPACE = "alpha"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="8192,131072", help="prompt lengths (default %(default)s)")
    p.add_argument("--reps", type=int, default=2001, help="interleaved reps per case (default %(default)s)")
    p.add_argument("--model", default="smollm2-135m", help="the ModelSpec whose keys and hit rule are used")
    p.add_argument("--sample-prompt-tokens", type=int, default=8192, help="prompt length filling the sample")
    p.add_argument("--no-redis", action="store_true", help="the embedded store only (no redis-server)")


def run(args: argparse.Namespace) -> None:
    try:
        lengths = [int(x) for x in args.tokens.split(",") if x.strip()]
        spec = ModelSpec.preset(args.model)
    except (ValueError, KeyError) as e:
        raise CliError(f"--tokens / --model: {e}") from None
    if not lengths or min(lengths) < 4 * spec.block_size or args.reps < 5 or args.sample_prompt_tokens < 1:
        raise CliError(f"--tokens must be >= {4 * spec.block_size} each, --reps >= 5, --sample-prompt-tokens >= 1")
    out: dict[str, Any] = {"model": spec.name, "reps": args.reps, "stores": {}}
    with tempfile.TemporaryDirectory(prefix="kvledger-misses-") as tmp:
        stores = [("embedded", lambda: BlockLedger.open(path=tmp, fsync=False))]
        server = None
        if not args.no_redis:
            from kvledger.util.redis_server import RedisServer

            server = RedisServer().start()
            stores.append(("redis", lambda: BlockLedger.open(redis_url=server.url)))
        try:
            for name, open_ledger in stores:
                with open_ledger() as ledger:
                    out["stores"][name] = {str(n): _lengths(ledger, spec, n, args.reps) for n in lengths}
        finally:
            if server is not None:
                server.stop()
    out["sample"] = _memory(spec, args.sample_prompt_tokens)
    emit_json(out) if args.json else _print(out)


def _lengths(ledger: BlockLedger, spec: ModelSpec, n: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    book = MissBook(spec.block_size)
    prompts = [rng.integers(3, 40000, n).astype(np.uint32) for _ in range(min(32, MAX_TOKENS // n))]
    for p in prompts[::-1]:   # the first one added last: the sample keeps it
        keys = chain_keys(p, spec, NAMESPACE)
        ledger.put_chain(keys, [b"\0" * 64] * len(keys), namespace=NAMESPACE)
        book.add(NAMESPACE, p, keys)
    hit = prompts[0]
    diverged = hit.copy()
    diverged[n // 2] += 1
    ledger.delete(chain_keys(diverged, spec, NAMESPACE)[n // 2 // spec.block_size:])   # as if never stored
    return {case: _case(ledger, spec, book, tokens, reps) for case, tokens in (("hit", hit), ("diverged", diverged))}


def _case(ledger: BlockLedger, spec: ModelSpec, book: MissBook, tokens: np.ndarray, reps: int) -> dict[str, Any]:
    def off() -> Any:
        return check_prompt(tokens, spec, block_ledger=ledger, state_ledger=None, namespace=NAMESPACE)

    def on() -> Any:
        return check_prompt_explained(tokens, spec, block_ledger=ledger, state_ledger=None, namespace=NAMESPACE)

    keys, lookup, found = on()
    absent = found.blocks * spec.block_size < max(lookup.decision.cap, 0)

    def cause() -> Any:   # at the request's end
        return book.first_absent(NAMESPACE, tokens, keys, found.blocks, found.gone) if absent else None

    first = cause()
    times: dict[str, list[float]] = {"off": [], "on": [], "cause": []}
    for i in range(reps):
        for name, fn in ((("off", off), ("on", on), ("cause", cause)) if i % 2
                         else (("on", on), ("off", off), ("cause", cause))):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    stat = {k: {"p50_ms": round(statistics.median(v), 4), "p99_ms": round(float(np.percentile(v, 99)), 4)}
            for k, v in times.items()}
    stat["cause_ms"] = stat.pop("cause")
    return {**stat, "on_over_off_p50": round(stat["on"]["p50_ms"] / stat["off"]["p50_ms"], 3),
            "on_over_off_p99": round(stat["on"]["p99_ms"] / stat["off"]["p99_ms"], 3),
            "cause": None if first is None else str(first.cause),
            "divergence": None if first is None else first.divergence}


def _memory(spec: ModelSpec, prompt_tokens: int) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    book = MissBook(spec.block_size)
    for _ in range(MAX_TOKENS // prompt_tokens + 4):   # past the cap: the oldest give way
        p = rng.integers(3, 40000, prompt_tokens).astype(np.uint32)
        book.add(NAMESPACE, p, chain_keys(p, spec, NAMESPACE))
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"prompt_tokens": prompt_tokens, "cap_tokens": MAX_TOKENS, "sample_bytes": book.sample_bytes(NAMESPACE),
            "traced_bytes": traced}


def _print(out: dict[str, Any]) -> None:
    for store, lengths in out["stores"].items():
        for n, cases in lengths.items():
            for case, r in cases.items():
                print(f"{store:<9} {n:>7} tokens  {case:<8}  CHECK off p50 {r['off']['p50_ms']:.3f} ms p99 "
                      f"{r['off']['p99_ms']:.3f}  on p50 {r['on']['p50_ms']:.3f} ms p99 {r['on']['p99_ms']:.3f}  "
                      f"on/off {r['on_over_off_p50']:.3f}; at the end, the cause ({r['cause']}) "
                      f"{r['cause_ms']['p50_ms']:.4f} ms")
    s = out["sample"]
    print(f"sample at its cap ({s['cap_tokens']:,} tokens): {s['sample_bytes']:,} B of ids and keys, "
          f"{s['traced_bytes']:,} B allocated in all")
