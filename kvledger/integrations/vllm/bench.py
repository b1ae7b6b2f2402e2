"""`kvledger bench vllm`: TTFT of a long prompt under vLLM, cold and on a hit, kvledger's connector
side by side with vLLM's in-tree ExampleConnector on the same prompts, in the same run.

Each connector gets its own vLLM process (CPU build, `.venv-vllm`), an empty store, and vLLM's own
prefix cache off, so every hit comes through the connector. The processes are alive together and
take requests one at a time, so a load on the machine falls on both alike; an idle engine uses
almost no CPU (measured in every run: `idle_engine_cpu_share`, the CPU the waiting engines used
over the wall time of the other's requests). After one warm-up request each (kernel set-up, not
counted), each round sends every engine a prompt no earlier round shared a block with (cold:
computed and saved), then the same prompt `--hits` times (hit: loaded), the engines alternating
request by request (A B B A …, and B first in every other round), so both connectors' hits of a
round lie within seconds of each other. TTFT is the wall time of a max_tokens=1 request; `*_cpu_s`
is the engine's CPU time for it (wall ≫ CPU means the machine was busy with other work). A round's
ratio is its median hit over its cold; figures are medians (`*_spread`: min and max of the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from kvledger.util.output import CliError, emit_json

WARMUP_TOKENS = 512
TIMEOUT_S = 1800.0  # one request on a loaded 2-core machine
HELP = "TTFT cold vs hit under vLLM: kvledger's connector beside vLLM's ExampleConnector"
EXAMPLES = ("kvledger bench vllm --json",  # `--help`'s epilog
            "kvledger bench vllm --model gemma3-270m --sizes 4096,16384 --repeat 3 --record docs/results")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    p.add_argument("--rounds", type=int, default=3, help="prompts per connector, each cold then hit")
    p.add_argument("--hits", type=int, default=3, help="hit requests per round and connector")
    p.add_argument("--plain", action="store_true", help="also time cold prompts on a vLLM without connector")
    p.add_argument("--dir", metavar="DIR", help="where the stores go (default: the temp dir)")
    hybrid = p.add_argument_group("a hybrid model (--model gemma3-270m): vLLM's hybrid KV cache manager on, "
                                  "kvledger beside vLLM's prefix cache, SimpleCPUOffload (disk) and MooncakeStore")
    hybrid.add_argument("--model", help="run the hybrid bench on this registered model (gemma3-270m)")
    hybrid.add_argument("--sizes", type=_sizes, default=[4096, 16384], metavar="N,N",
                        help="prompt lengths in tokens")
    hybrid.add_argument("--repeat", type=int, default=3, help="runs of each kind per size")
    hybrid.add_argument("--chunk", type=int, default=4096, help="vLLM's max_num_batched_tokens (prefill chunk)")
    hybrid.add_argument("--peers", type=lambda v: [x for x in v.split(",") if x],
                        default=["mooncake", "simple_cpu_offload_disk"], metavar="NAME,NAME",
                        help="peer connectors to try")


def _sizes(value: str) -> list[int]:
    sizes = [int(x) for x in value.split(",") if x]
    if not sizes or min(sizes) < 256:
        raise argparse.ArgumentTypeError("prompt lengths of at least 256 tokens, comma-separated")
    return sizes


def measure(engines: dict[str, Any], tokens: int, rounds: int, hits: int,
            prompt_of: Callable[[int, int], list[int]] | None = None) -> dict[str, dict[str, Any]]:
    """All engines alive at once, one request at a time, alternating (see the module docstring).
    `prompt_of(tokens, variant)`: the prompts (default `prompts.long_prompt`)."""
    if prompt_of is None:
        from kvledger.integrations.vllm.prompts import long_prompt as prompt_of
    runs: dict[str, dict[str, list]] = {name: {"cold": [], "cold_cpu": [], "hit": [], "hit_cpu": [], "loaded": [],
                                               "same": []} for name in engines}
    idle = [0.0, 0.0]  # CPU the waiting engines used, wall time of the requests they waited through
    for engine in engines.values():  # kernel set-up on a short prompt (not counted)
        engine.generate(prompt_of(min(tokens, WARMUP_TOKENS), 10_000), max_tokens=1, timeout_s=TIMEOUT_S)
    for r in range(rounds):
        prompt = prompt_of(tokens, r + 1)
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        first: dict[str, dict[str, Any]] = {}
        for name in order:
            first[name] = timed(engines, name, prompt, idle)
            runs[name]["cold"].append(first[name]["seconds"])
            runs[name]["cold_cpu"].append(first[name]["cpu_s"])
            runs[name]["hit"].append([])
            runs[name]["hit_cpu"].append([])
        hitters = [name for name in order if engines[name].opts.get("connector") is not None]
        for h in range(hits):
            for name in hitters if h % 2 else hitters[::-1]:
                b = timed(engines, name, prompt, idle)
                runs[name]["hit"][-1].append(b["seconds"])
                runs[name]["hit_cpu"][-1].append(b["cpu_s"])
                runs[name]["loaded"].append(b["num_cached_tokens"])
                runs[name]["same"].append(first[name]["tokens"] == b["tokens"])
    share = idle[0] / idle[1] if idle[1] else 0.0
    return {name: summarize_engine(run, engines[name].start_s) | {"idle_engine_cpu_share": share}
            for name, run in runs.items()}


def timed(engines: dict[str, Any], name: str, prompt: list[int], idle: list[float]) -> dict[str, Any]:
    """One max_tokens=1 request to engine `name`: its result, with the engine's CPU seconds for it;
    adds the other engines' CPU over that time to `idle`."""
    before = {n: e.cpu_s() for n, e in engines.items()}
    out = engines[name].generate(prompt, max_tokens=1, timeout_s=TIMEOUT_S)
    used = {n: e.cpu_s() - before[n] for n, e in engines.items()}
    idle[0] += sum(v for n, v in used.items() if n != name)
    idle[1] += out["seconds"] * (len(engines) - 1)
    return out | {"cpu_s": used[name]}


def load_events(path: Path) -> dict[str, float]:
    """From the connector's event log: the median wall time of a hit's read (in the copier thread)
    and the median time the forward blocked on it (`waited_s`: the load compute did not hide)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    loads = [e for e in lines if e["event"] == "load" and e["ok"] > 0]
    if not loads:
        return {}
    return {"load_read_s": statistics.median(e["seconds"] for e in loads),
            "load_waited_s": statistics.median(e.get("waited_s", 0.0) for e in loads)}


def summarize_engine(run: dict[str, list], start_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"ttft_cold_s": statistics.median(run["cold"]), "cold_s": run["cold"],
                           "cold_cpu_s": run["cold_cpu"], "start_s": start_s}
    if run["loaded"]:
        ratios = [statistics.median(h) / c for h, c in zip(run["hit"], run["cold"])]
        flat = [x for h in run["hit"] for x in h]
        out.update(ttft_hit_s=statistics.median(flat), hit_s=run["hit"], hit_cpu_s=run["hit_cpu"],
                   ttft_hit_cpu_s=statistics.median(x for h in run["hit_cpu"] for x in h),
                   hit_over_cold=statistics.median(ratios), spread=[min(ratios), max(ratios)],
                   hit_tokens=min(run["loaded"]), same_first_token=all(run["same"]))
    return out


def run(args: argparse.Namespace) -> None:
    from kvledger.engine.models import registry
    from kvledger.integrations.vllm.client import VLLM_PYTHON, EngineError, VllmProcess, wait_all

    if getattr(args, "model", None):
        return run_hybrid(args)
    if args.tokens < 256 or args.rounds < 1 or args.hits < 1:
        raise CliError("--tokens must be at least 256, --rounds and --hits at least 1")
    if not VLLM_PYTHON.exists():
        raise CliError(f"{VLLM_PYTHON} is missing: run `make vllm-venv`")
    entry = registry.resolve(registry.DEFAULT_MODEL)   # SmolLM2, as a Hugging Face folder vLLM loads
    model = str(entry.weights.folder())
    base = Path(tempfile.mkdtemp(prefix="kvledger-bench-vllm-", dir=args.dir))
    # One prefill chunk for the whole prompt, for every engine: vLLM 0.32's ExampleConnector saves
    # only a prompt's first chunk and then fails its load with a shape mismatch (seen here with
    # max_num_batched_tokens=2048 on a 4,096-token prompt); kvledger's connector saves every chunk.
    common = {"model": model, "max_num_batched_tokens": max(8192, args.tokens), "max_model_len": args.tokens + 1024}
    events = base / "kvledger-events.jsonl"
    opts = {"kvledger": {**common, "connector": "kvledger", "store": str(base / "kvledger"),
                         "model_name": entry.name, "events": str(events)},
            "example": {**common, "connector": "example", "store": str(base / "example")}}
    if args.plain:
        opts["plain"] = {**common, "connector": None}
    engines = {name: VllmProcess(o) for name, o in opts.items()}
    args.load_before = os.getloadavg()[0]
    try:
        wait_all(list(engines.values()))
        figures = measure(engines, args.tokens, args.rounds, args.hits)
        figures["kvledger"].update(load_events(events))
    except EngineError as e:
        raise CliError(str(e)) from None
    finally:
        for engine in engines.values():
            engine.__exit__(None, None, None)
        shutil.rmtree(base, ignore_errors=True)
    kvl, ex, plain = figures["kvledger"], figures["example"], figures.get("plain")
    _output(args, summarize(args, kvl, ex, plain), print_table)


def _output(args: argparse.Namespace, result: dict[str, Any], table: Any) -> None:
    """The result into --out DIR/vllm.json, then one JSON object (--json) or `table(result)`."""
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "vllm.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        emit_json(result)
    else:
        table(result)


def run_hybrid(args: argparse.Namespace) -> None:
    """`--model NAME`: `hybrid_bench`'s run, printed as a table or one JSON object."""
    from kvledger.engine.models import registry
    from kvledger.integrations.vllm import hybrid_bench
    from kvledger.integrations.vllm.client import VLLM_PYTHON, EngineError

    if args.model not in registry.NAMES or not registry.cli_resolve(args.model).spec.has_swa:
        raise CliError(f"--model {args.model}: a registered model with sliding-window layers (gemma3-270m)")
    unknown = sorted(set(args.peers) - set(hybrid_bench.PEERS))
    if args.repeat < 1 or unknown:
        raise CliError(f"--repeat must be at least 1; --peers takes {','.join(hybrid_bench.PEERS)} (not {unknown})")
    if not VLLM_PYTHON.exists():
        raise CliError(f"{VLLM_PYTHON} is missing: run `make vllm-venv`")
    try:
        result = hybrid_bench.run(args)
    except (EngineError, ValueError) as e:
        raise CliError(str(e)) from None
    _output(args, result, print_hybrid_table)


def print_hybrid_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvledger.integrations.vllm.hybrid_report import table_lines

    t = Table(title=f"TTFT under vLLM, {r['model']}: median (min–max) of {r['repeat']} runs")
    for col in ("prompt", "run", "cold s", "hit s", "hit tokens", "hit / cold", "hit / vLLM hit", "greedy 16 = cold"):
        t.add_column(col, justify="right")
    for line in table_lines(r):
        t.add_row(*line)
    console = Console()
    console.print(t)
    for b in r["bytes_per_cached_token"]:
        parts = [f"{b['prompt_tokens']:,} tokens: all layers {b['all_layers']:,} B/token"]
        if "kvledger" in b:
            parts.append(f"kvledger {b['kvledger']:,.0f} (× {b['kvledger_over_all_layers']:.3f})")
        if "mooncake" in b:
            parts.append(f"MooncakeStore {b['mooncake']:,.0f} (× {b['mooncake_over_all_layers']:.3f})")
        console.print("; ".join(parts))


def summarize(args: argparse.Namespace, kvl: dict[str, Any], ex: dict[str, Any],
              plain: dict[str, Any] | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "bench": "vllm", "model": "SmolLM2-135M-Instruct (bf16, vLLM CPU)", "prompt_tokens": args.tokens,
        "rounds": args.rounds, "hits": args.hits, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "load_avg_1m": [round(args.load_before, 2), round(os.getloadavg()[0], 2)],
        "idle_engine_cpu_share": kvl["idle_engine_cpu_share"],
        "ttft_hit_cpu_s": kvl["ttft_hit_cpu_s"], "example_connector_ttft_hit_cpu_s": ex["ttft_hit_cpu_s"],
        "hit_over_example_hit": statistics.median(statistics.median(a) / statistics.median(b)
                                                  for a, b in zip(kvl["hit_s"], ex["hit_s"])),
        "load_read_s": kvl.get("load_read_s"), "load_waited_s": kvl.get("load_waited_s"),
        "ttft_cold_s": kvl["ttft_cold_s"], "ttft_hit_s": kvl["ttft_hit_s"], "hit_over_cold": kvl["hit_over_cold"],
        "hit_over_cold_spread": kvl["spread"], "hit_tokens": kvl["hit_tokens"],
        "example_connector_ttft_cold_s": ex["ttft_cold_s"], "example_connector_ttft_hit_s": ex["ttft_hit_s"],
        "example_connector_hit_over_cold": ex["hit_over_cold"], "example_connector_spread": ex["spread"],
        "example_connector_hit_tokens": ex["hit_tokens"],
        "same_first_token": kvl["same_first_token"] and ex["same_first_token"],
        "kvledger": kvl, "example_connector": ex,
    }
    if plain is not None:
        result["plain_ttft_cold_s"] = plain["ttft_cold_s"]
        result["plain"] = plain
    return result


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"TTFT under vLLM, {r['prompt_tokens']:,}-token prompt (median of {r['rounds']} rounds)")
    for col in ("connector", "cold s", "hit s", "hit / cold", "tokens loaded"):
        t.add_column(col, justify="right")
    t.add_row("kvledger", f"{r['ttft_cold_s']:.2f}", f"{r['ttft_hit_s']:.2f}", f"{r['hit_over_cold']:.3f}",
              f"{r['hit_tokens']:,}")
    t.add_row("ExampleConnector", f"{r['example_connector_ttft_cold_s']:.2f}",
              f"{r['example_connector_ttft_hit_s']:.2f}", f"{r['example_connector_hit_over_cold']:.3f}",
              f"{r['example_connector_hit_tokens']:,}")
    if "plain_ttft_cold_s" in r:
        t.add_row("none", f"{r['plain_ttft_cold_s']:.2f}", "-", "-", "0")
    console = Console()
    console.print(t)
    console.print(f"kvledger hit / ExampleConnector hit, same round: {r['hit_over_example_hit']:.3f}; "
                  f"kvledger's read of a hit {r['load_read_s'] or 0:.3f} s, of which the forward waited "
                  f"{r['load_waited_s'] or 0:.3f} s")
