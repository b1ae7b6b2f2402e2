"""What the reference-engine benches (`ttft`, `accuracy`, `rag`) share on the command line: torch's thread
count, the checkpoint period, and running `measure` into one JSON object or a table."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvledger.engine import threads
from kvledger.util.output import CliError, emit_json

add_threads_arg = threads.add_threads_arg

__all__ = ["add_threads_arg", "add_period_arg", "check_period", "run_measure"]


def add_period_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--period", type=int, default=512,
                   help="a checkpoint every N prompt tokens, a multiple of 128 (default %(default)s)")


def check_period(period: int) -> None:
    if period < 128 or period % 128:
        raise CliError(f"--period must be a positive multiple of the 128-token block, got {period}")


def run_measure(args: argparse.Namespace, measure: Callable[[], dict[str, Any]],
                print_table: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """`measure()` with --threads torch threads (a ValueError is a one-line CLI error), then its JSON (--json)
    or its table; the result."""
    try:
        n = threads.set_threads(threads.resolve_threads(args.threads))
        result = measure()
    except ValueError as e:
        raise CliError(str(e)) from None
    result["threads"] = n
    if args.json:
        emit_json(result)
    else:
        print_table(result)
    return result
