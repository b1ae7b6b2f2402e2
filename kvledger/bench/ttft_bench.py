"""`kvledger bench ttft`: time to first token of one prompt cold and on each kind of hit, side by side in one run.

On one engine and a fresh embedded block ledger (plus a state ledger for windowed models), the prompt (N
deterministic pseudo-random token ids) is first prefilled cold with a checkpoint every `--period` tokens
(rule 4′), which stores its blocks and snapshots. Then, `--repeat` times each, the device prefix cache
emptied before every hit run so its blocks come through the fetcher process:

    | run       | what the engine is given                         | exact | computes                    |
    |-----------|--------------------------------------------------|-------|-----------------------------|
    | stored    | the first cold prefill, which also checkpoints   | yes   | [0, L), snapshots every P   |
    | cold      | a miss (a namespace of its own each time)        | yes   | [0, L)                      |
    | hit       | blocks to L1 (and the snapshot at L1: rule 3)    | yes   | [L1, L)                     |
    | device    | the hit again, its blocks still in the engine    | yes   | [L1, L)                     |
    | serial    | the hit, its forward after the whole fetch       | yes   | [L1, L)                     |
    | periodic  | blocks and the latest checkpoint q < L1 (rule 3′)| yes   | [q, L): L1 − q ≤ P more     |
    | fallback  | blocks, no snapshot: windows truncated at L1 − B | no    | [L1 − B, L), every layer    |
    | replay    | blocks, no snapshot: bounded replay of [L1−B, L1)| no    | [L1 − B, L), windowed layers|

The last three are for windowed models (a full-attention model's hit needs no snapshot: its runs are cold,
hit, device and serial). "serial" is the baseline of a streamed hit (`engine/loader.py`: the engine alone, full
attention, the forward computing layer by layer as the blocks arrive): the same hit with streaming off, so that
its forward starts once every block is in, as every hit did before; `streamed_over_serial` is the ratio of their
median TTFTs (windowed models stream no hit and have no serial run; nor does a run where hits do not stream:
`--stream-hits`, whose auto is the engine's default). `--drop-cache` evicts the ledger's segment
files from the page cache (`posix_fadvise` DONTNEED) before every hit and serial run, and the floor's plain file
before each read, so the fetch reads the disk (the ledger's other files, its index, too).

Each run generates 32 greedy tokens; TTFT counts from the start of CHECK to the first token and is split into
CHECK, fetch, swap-in and compute. Reported per run kind: the median TTFT and its spread (min,
max), the median ratio to cold, the max relative logit error of the first token against the stored run,
and whether the 32 greedy tokens equal cold's. "stored" (n = 1) prices periodic checkpointing against cold.

`bytes` says what the stored run left on the ledgers, measured: the block ledger's files and the snapshots in
host memory, per stored token, with rule 4's snapshots only and with the checkpoints too, against a store
that keeps every layer's K and V per token (`ModelSpec.all_layers_bytes_per_token`).

`floor`: what a hit cannot go below on this machine. Its bytes must be read: a plain `preadv` of as many bytes as
the hit's blocks, from a file in the ledger's folder and the page cache as warm as the ledger's (the median of
`--repeat` reads into one buffer), `read_s`; and its forward must run: the device run's TTFT (CHECK and the
forward of what the hit computes, with nothing to fetch), `device_ttft_s`. A streamed hit (the engine alone, full
attention: `engine/loader.py`) reads layer by layer under its forward, so its floor is the longer of the two; a
hit that waits for its whole fetch first, the sum (`serial_floor_s`, the floor of every hit before streaming):
`floor_s`, `floor_over_cold`, and `hit_over_floor`; `streamed` says which.

`overlap_fraction` is the share of fetch + swap-in that compute hid, in the first hit run: (swap-in copy time −
time the forward waited for it, + for a streamed hit fetch time − time the forward waited for parts) / (fetch +
swap-in copy time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

HELP = "engine TTFT: cold vs each hit kind (snapshot, periodic checkpoint, fallback, replay), median and spread"
EXAMPLES = ("kvledger bench ttft --tokens 4096 --json",
            "kvledger bench ttft --model gemma3-270m --tokens 16384 --repeat 3 --record docs/results")
GREEDY_TOKENS = 32
KINDS = ("cold", "hit", "device", "serial", "periodic", "fallback", "replay")   # each --repeat times, after "stored"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.bench.engine_cli import add_period_arg, add_threads_arg
    from kvledger.engine.models.registry import add_model_arg
    from kvledger.engine.threads import add_stream_hits_arg

    add_model_arg(p)
    p.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each kind (default %(default)s)")
    add_period_arg(p)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk in tokens (default %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    add_threads_arg(p)
    p.add_argument("--data-dir", help="block ledger folder (default: a fresh temporary one)")
    add_stream_hits_arg(p)
    p.add_argument("--drop-cache", action="store_true", help="evict the ledger's files from the page cache before "
                   "every hit run, so the fetch reads the disk (default: as warm as just after the write)")


def _prompt(n: int, vocab: int) -> list[int]:
    return np.random.default_rng(1234).integers(100, min(vocab, 40000), n).tolist()


def _decision(kind: str, tokens: list[int], engine: Any, ledger: Any, states: Any, namespace: str) -> tuple:
    """(keys, the decision a run of `kind` follows), from the ledgers' CHECK and the core rule."""
    from kvledger.core import decide_hit
    from kvledger.entrypoint.check import check_prompt

    spec = engine.spec
    if kind in ("stored", "cold", "hit", "device", "serial"):
        return check_prompt(tokens, spec, block_ledger=ledger, state_ledger=states, namespace=namespace)
    if kind == "replay":
        return check_prompt(tokens, spec, block_ledger=ledger, state_ledger=None, namespace=namespace, replay=True)
    keys, full = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=states, namespace=namespace)
    held = full.block_hit_tokens // spec.block_size
    if kind == "fallback":   # the same model deciding as V4 does (rule 3): windows truncated at L1 − B
        return keys, decide_hit(len(tokens), held, set(), replace(spec, approximate_fallback=True))
    older = {x for x in states.positions(keys) if x < full.block_hit_tokens}
    return keys, decide_hit(len(tokens), held, older, spec)


def _run(engine: Any, ledger: Any, states: Any, tokens: list[int], rid: str, kind: str, namespace: str,
         greedy: int = GREEDY_TOKENS) -> dict[str, Any]:
    """CHECK + generate `greedy` greedy tokens; the first-token split, the tokens, the decision."""
    from kvledger.engine.api import EngineRequest, SamplingParams

    t0 = time.perf_counter()
    keys, decision = _decision(kind, tokens, engine, ledger, states, namespace)
    check_s = time.perf_counter() - t0
    engine.add_request(EngineRequest(rid, tokens, keys, decision,
                                     SamplingParams(max_tokens=greedy, ignore_eos=True), namespace=namespace))
    out: list[int] = []
    ttft = usage = None
    while engine.has_unfinished():
        for event in engine.step():
            if ttft is None and event.token_ids:
                ttft, usage = time.perf_counter() - t0, event.usage
            out += event.token_ids
    engine.wait_stored()
    engine.check_integrity()
    t = usage.timings
    split = {"check_s": check_s, "fetch_s": t.get("fetch_s", 0.0), "swapin_s": t.get("swapin_s", 0.0),
             "swapin_wait_s": t.get("swapin_wait_s", 0.0), "compute_s": t.get("compute_s", 0.0), "ttft_s": ttft,
             "streamed": "fetch_wait_s" in t, "fetch_wait_s": t.get("fetch_wait_s", 0.0)}
    return {"split": split, "tokens": out, "decision": decision.kind.value, "hit_kind": usage.hit_kind,
            "cached_tokens": usage.cached_tokens, "computed_tokens": len(tokens) - decision.recompute_from,
            "logits": engine.first_logits.pop(rid)}


def _overlap(split: dict[str, float]) -> float:
    moved = split["fetch_s"] + split["swapin_s"]
    hidden = max(split["swapin_s"] - split["swapin_wait_s"], 0.0)
    if split["streamed"]:
        hidden += max(split["fetch_s"] - split["fetch_wait_s"], 0.0)
    return hidden / moved if moved > 0 else 0.0


def measure(model: str, tokens: int, device: str, data_dir: str, *, repeat: int = 3, period: int = 512,
            chunk: int = 4096, greedy: int = GREEDY_TOKENS, drop_cache: bool = False,
            stream_hits: bool | None = None) -> dict[str, Any]:
    from kvledger.engine.engine import Engine
    from kvledger.engine.models.registry import resolve
    from kvledger.store.ledger import BlockLedger

    entry = resolve(model)
    spec = entry.spec
    ledger = BlockLedger.open(path=data_dir)
    states = None
    if spec.has_swa:
        from kvledger.state.ledger import StateLedger

        states = StateLedger(spec, token="bench-ttft", serve=False, heartbeat=False,
                             capacity_bytes=max(256 << 20, 4 * (tokens // period + 2) * spec.state_size_to_disk())
                             ).start()
    engine = Engine(entry, block_ledger=ledger, state_ledger=states, device=device, max_num_seqs=1,
                    max_num_batched_tokens=min(chunk, tokens), checkpoint_every=period if spec.has_swa else 0,
                    stream_hits=stream_hits)
    engine.record_logits = True
    streams = engine.loader.streams   # a hit's forward may start before its fetch ends (then: a serial baseline)
    kinds = tuple(k for k in KINDS if (k != "serial" or streams) and (spec.has_swa or k in KINDS[:4]))
    runs: dict[str, list[dict]] = {"stored": [], **{k: [] for k in kinds}}
    try:
        if tokens + greedy > engine.max_model_len:
            raise ValueError(f"--tokens {tokens} + {greedy} greedy tokens do not fit {model}'s context of "
                             f"{engine.max_model_len}: at most {engine.max_model_len - greedy} tokens")
        prompt = _prompt(tokens, engine.model.vocab_size)
        runs["stored"].append(_run(engine, ledger, states, prompt, "stored", "stored", "bench", greedy))
        kept = _bytes_kept(spec, prompt, ledger, states)
        engine.checkpoint_every = 0
        for i in range(repeat):
            for kind in kinds:
                if kind != "device":   # the device run follows the hit, whose blocks the engine still holds
                    engine.clear_device_cache()
                ns = f"cold-{i}" if kind == "cold" else "bench"
                if drop_cache and kind not in ("cold", "device"):
                    evict(Path(data_dir))
                engine.loader.streams = streams and kind != "serial"
                runs[kind].append(_run(engine, ledger, states, prompt, f"{kind}-{i}", kind, ns, greedy))
    finally:
        engine.close()
        if states is not None:
            states.close()
        ledger.close()
    out = _report(model, tokens, device, period, greedy, runs) | {"bytes": kept}
    hit_blocks = -(-out["runs"]["hit"]["cached_tokens"] // spec.block_size)
    out["floor"] = _floor(out, plain_read_s(data_dir, hit_blocks * spec.block_bytes(), repeat, cold=drop_cache))
    out["drop_cache"], out["stream_hits"] = drop_cache, streams
    if streams:
        out["streamed_over_serial"] = out["runs"]["hit"]["ttft_s"] / out["runs"]["serial"]["ttft_s"]
    return out


def evict(folder: Path) -> None:
    """Drop every file under `folder` from the page cache (`evict_file`)."""
    for path in folder.rglob("*"):
        if path.is_file():
            evict_file(path)


def evict_file(path: Path) -> None:
    """Drop `path`'s pages from the page cache (written out first: `posix_fadvise` DONTNEED drops clean pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read_s(folder: str, nbytes: int, repeat: int, *, cold: bool = False) -> float:
    """Median seconds of a plain read (`store_bench.read_plain_file`) of `nbytes` from a file in `folder`, written
    and fsynced first, read once untimed (the page cache as warm as a ledger read just after its write), then
    `repeat` times into one buffer (`cold`: each from the disk, the file evicted first). The file is removed."""
    from kvledger.bench.store_bench import read_plain_file, write_plain_file

    buf = np.ones(nbytes, dtype=np.uint8)
    path = Path(folder) / "plain-read.bin"
    write_plain_file(path, buf)
    try:
        times = []
        for _ in range(repeat + 1):
            if cold:
                evict_file(path)
            t = time.perf_counter()
            read_plain_file(path, buf)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])
    finally:
        path.unlink(missing_ok=True)


def _floor(out: dict[str, Any], read_s: float) -> dict[str, Any]:
    """The module docstring's floor, from the device run and the plain read."""
    cold, hit, device = (out["runs"][k]["ttft_s"] for k in ("cold", "hit", "device"))
    streamed = out["runs"]["hit"]["split"]["streamed"]
    floor = max(read_s, device) if streamed else read_s + device
    return {"read_s": read_s, "device_ttft_s": device, "streamed": streamed, "floor_s": floor,
            "serial_floor_s": read_s + device, "floor_over_cold": floor / cold, "hit_over_floor": hit / floor}


def _bytes_kept(spec: Any, prompt: list[int], ledger: Any, states: Any) -> dict[str, Any]:
    """What the stored run put on the ledgers: block files and snapshots, per stored token (module docstring)."""
    from kvledger.core import chain_keys, prefill_store_positions

    disk = ledger.stats().disk_bytes
    stored = len(prompt) // spec.block_size * spec.block_size
    held = states.positions(chain_keys(prompt, spec, "bench")) if states is not None else set()
    rule4 = len(held & set(prefill_store_positions(len(prompt), spec)))
    size, per_token = spec.state_size_to_disk(), spec.all_layers_bytes_per_token()

    def per(snapshots: int) -> float:
        return (disk + snapshots * size) / stored

    return {"block_disk_bytes": disk, "stored_tokens": stored, "snapshot_bytes": size, "snapshots_rule4": rule4,
            "snapshots_checkpoints": len(held) - rule4, "per_stored_token_rule4": per(rule4),
            "per_stored_token_with_checkpoints": per(len(held)), "all_layers_per_token": per_token,
            "vs_all_layers_rule4": per(rule4) / per_token, "vs_all_layers_with_checkpoints": per(len(held)) / per_token}


def _report(model: str, tokens: int, device: str, period: int, greedy: int, runs: dict[str, list[dict]]
            ) -> dict[str, Any]:
    ref, cold = runs["stored"][0], statistics.median(r["split"]["ttft_s"] for r in runs["cold"])

    def rel(run: dict) -> float:
        return float((run["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max())

    out: dict[str, Any] = {"model": model, "tokens": tokens, "device": device, "period": period,
                           "greedy_tokens": greedy, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "runs": {}}
    for kind, rs in runs.items():
        ttfts = [r["split"]["ttft_s"] for r in rs]
        out["runs"][kind] = {
            "n": len(rs), "ttft_s": statistics.median(ttfts), "ttft_spread_s": [min(ttfts), max(ttfts)],
            "over_cold": statistics.median(t / cold for t in ttfts),
            "hit_kind": rs[0]["hit_kind"], "cached_tokens": rs[0]["cached_tokens"],
            "computed_tokens": rs[0]["computed_tokens"],
            "logits_max_rel_err": max(rel(r) for r in rs),
            "greedy_match": all(r["tokens"] == ref["tokens"] for r in rs),
            "split": rs[0]["split"],
        }
    out["hit_over_cold"] = out["runs"]["hit"]["over_cold"]
    out["overlap_fraction"] = _overlap(runs["hit"][0]["split"])
    return out


def run(args: argparse.Namespace) -> None:
    import json

    from kvledger.bench.engine_cli import check_period, run_measure
    from kvledger.engine.models.registry import cli_resolve
    from kvledger.engine.threads import stream_hits
    from kvledger.util.output import CliError

    cli_resolve(args.model)
    if args.tokens < 2 * 128:
        raise CliError("--tokens must be at least 256 (a hit needs a whole block before the cap)")
    if args.repeat < 1 or args.chunk < 1:
        raise CliError("--repeat and --chunk must be at least 1")
    check_period(args.period)

    def measured() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="kvledger-ttft-") as tmp:
            result = measure(args.model, args.tokens, args.device, args.data_dir or tmp, repeat=args.repeat,
                             period=args.period, chunk=args.chunk, drop_cache=args.drop_cache,
                             stream_hits=stream_hits(args.stream_hits))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "ttft.json").write_text(json.dumps(result, indent=2))
        return result

    run_measure(args, measured, _print_table)


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"TTFT, {r['model']}, {r['tokens']} tokens, {r['device']} (median of n; checkpoints every "
                        f"{r['period']})")
    for col in ("run", "n", "TTFT s", "spread s", "× cold", "cached", "computed", "rel err", "greedy = cold"):
        table.add_column(col, justify="right")
    for name, s in r["runs"].items():
        lo, hi = s["ttft_spread_s"]
        table.add_row(name, str(s["n"]), f"{s['ttft_s']:.3f}", f"{lo:.3f}–{hi:.3f}", f"{s['over_cold']:.3f}",
                      str(s["cached_tokens"]), str(s["computed_tokens"]), f"{s['logits_max_rel_err']:.1e}",
                      str(s["greedy_match"]))
    console = Console()
    console.print(table)
    console.print(f"overlap of fetch + swap-in with compute (first hit run): {r['overlap_fraction']:.2f}")
    if "streamed_over_serial" in r:
        console.print(f"streamed hit / serial hit (its forward after the whole fetch): "
                      f"{r['streamed_over_serial']:.3f}" + (" (page cache dropped before each)" if r["drop_cache"]
                                                             else ""))
    f = r["floor"]
    how = "the longer of" if f["streamed"] else "the sum of"
    console.print(f"floor: {how} a plain read of the hit's bytes {f['read_s']:.3f} s and the device run "
                  f"{f['device_ttft_s']:.3f} s = {f['floor_s']:.3f} s (× {f['floor_over_cold']:.4f} of cold); "
                  f"the hit is × {f['hit_over_floor']:.2f} of it")
    b = r["bytes"]
    console.print(f"bytes kept per stored token: {b['per_stored_token_rule4']:,.0f} with rule 4's "
                  f"{b['snapshots_rule4']} snapshot(s) (× {b['vs_all_layers_rule4']:.3f} of an all-layers store, "
                  f"{b['all_layers_per_token']:,} B), {b['per_stored_token_with_checkpoints']:,.0f} with "
                  f"{b['snapshots_checkpoints']} checkpoints too (× {b['vs_all_layers_with_checkpoints']:.3f})")
