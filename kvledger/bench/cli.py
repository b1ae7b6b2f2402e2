"""`kvledger bench NAME`: each benchmark is a module with `HELP`, `EXAMPLES` (command lines for
`--help`), `add_arguments(parser)` and `run(args)`; its docstring's first paragraph is the
description. Every bench takes `--json` (one JSON object on stdout, its figures side by side
with its baseline) and `--out DIR` (the JSON and PNG charts written there)."""

from __future__ import annotations

import argparse
import importlib
import signal
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvledger.bench.record import recorded
from kvledger.util.output import examples

BENCHES = {
    "store": "kvledger.bench.store_bench",   # block ledger: read/write vs plain files, CHECK vs vLLM-style hashing
    "state": "kvledger.bench.state_bench",   # state ledger: snapshot pulls vs a plain socket, directory lookups
    "sim": "kvledger.bench.sim",             # cluster simulator driven by a trace
    "serve": "kvledger.bench.serve_bench",   # kvledger serve under multi-turn chats vs --no-cache
    "ttft": "kvledger.bench.ttft_bench",     # reference engine: TTFT cold vs each hit kind
    "preempt": "kvledger.bench.preempt_bench",   # reference engine at 2× oversubscription: preemption vs reserve
    "accuracy": "kvledger.bench.hit_accuracy",   # each hit kind's greedy tokens and logits vs cold, real text
    "rag": "kvledger.bench.rag_bench",       # a shared document and many questions, per snapshot strategy
    "vllm": "kvledger.integrations.vllm.bench",  # TTFT under vLLM: kvledger's connector vs ExampleConnector
    "scale": "kvledger.bench.scale_bench",   # block ledger at node scale: persisted index vs the previous design
    "redis-cluster": "kvledger.bench.redis_cluster_bench",  # CHECK on a 3-master Redis Cluster vs one server
    "replay": "kvledger.bench.replay",       # live trace replay per routing policy vs the simulator's prediction
    "mount": "kvledger.bench.mount_bench",   # cluster block ledger on a local folder vs a JuiceFS volume
    "chaos": "kvledger.bench.chaos",         # the cluster on JuiceFS under faults, every reply checked
    "misses": "kvledger.bench.misses_bench", # miss attribution: the CHECK with it on vs off, the sample's memory
    "whatif": "kvledger.bench.whatif_bench",  # kvledger whatif's prediction vs a live rerun, per changed setting
    "pd": "kvledger.bench.pd_bench",         # P/D decode leg: the prompt's tail handed over vs recomputed
    "threads": "kvledger.bench.threads_bench",   # kvledger serve per torch thread count, quiet and loaded
    "topology": "kvledger.bench.topology_bench",  # multi-turn replies per topology vs one no-cache engine
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks, each side by side with its baseline",
                            description="Benchmarks, each printing its figures side by side with its baseline "
                            "(--json: one JSON object;\n--out DIR: the JSON and PNG charts; --record DIR: the run "
                            "kept, with its command,\ncommit, date and machine load).",
                            epilog=examples("kvledger bench ttft --json", "kvledger bench NAME --help"))
    benches = parser.add_subparsers(dest="bench", required=True, parser_class=type(parser))
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        p = benches.add_parser(name, help=module.HELP, description=_description(module),
                               epilog=examples(*module.EXAMPLES))
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("--out", metavar="DIR", help="write the JSON and PNG charts into DIR")
        p.add_argument("--record", metavar="DIR", help="keep the run: its JSON plus the command, commit, date and "
                       f"machine load in DIR/{name}-<UTC time>.json (docs/results/)")
        module.add_arguments(p)
        p.set_defaults(func=terminable(recorded(name, module.run)))


def terminable(run: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`run` with SIGTERM ending it as an exception does (SystemExit 143, 128 + SIGTERM), so that its `finally`
    blocks stop what it started: the load burners, the servers, the role processes a bench runs. Python's
    default for SIGTERM is to die at once, leaving every child spinning on."""

    def run_terminable(args: Any) -> Any:
        def on_term(signum: int, frame: object) -> None:
            raise SystemExit(128 + signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            return run(args)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return run_terminable


def _description(module: ModuleType) -> str:
    """The first paragraph of a bench module's docstring (it names the command and what it compares)."""
    return (module.__doc__ or module.HELP).strip().split("\n\n")[0]
