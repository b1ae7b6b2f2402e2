"""`kvledger demo`: the main job on built-in examples (`run_demo`).

The demo is a tool above the product, as the bench is (DESIGN.md "Layout"): a client of `kvledger serve` and of
the ledgers' APIs, and its last step runs the bench's cluster simulator. `kvledger.cli` imports this module only
to run `kvledger demo` (its `TOOLS` table)."""

from __future__ import annotations

import argparse

from kvledger.util.output import examples

HELP = "the main job on built-in examples"


def register(sub: argparse._SubParsersAction) -> None:
    dm = sub.add_parser("demo", help=HELP,
                        description="The main job on built-in examples: the V4 capacity plan, a prompt diff, "
                        "hit decisions,\nblocks stored and read back, and a chat with SmolLM2 whose later turns "
                        "hit the cache.",
                        epilog=examples("kvledger demo", "kvledger demo --turns 0   # without the chat (no model "
                                        "load)"))
    dm.add_argument("--turns", type=int, default=3, choices=range(4), metavar="{0..3}",
                    help="chat turns with SmolLM2 on the reference engine (default %(default)s; 0: skip the chat)")
    dm.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kvledger.demo import run_demo

    run_demo(Console(), chat_turns=args.turns)
