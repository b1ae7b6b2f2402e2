"""What the reference-engine benches (`ttft`, `accuracy`, `rag`) share on the command line: torch's thread
count, the checkpoint period, and running `measure` into one JSON object or a table."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from kvledger.util.output import CliError, emit_json


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads on CPU (default %(default)s: the cores this process may run on, as "
                        "`kvledger serve` uses; 1 on a machine loaded by other jobs, where more threads spin)")


def torch_threads(requested: int) -> int:
    """The thread count --threads asks for: `requested`, or with 0 the CPUs this process may run on."""
    if requested < 0:
        raise CliError(f"--threads must be >= 0, got {requested}")
    return requested or len(os.sched_getaffinity(0))


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
    import torch

    torch.set_num_threads(torch_threads(args.threads))
    try:
        result = measure()
    except ValueError as e:
        raise CliError(str(e)) from None
    result["threads"] = torch.get_num_threads()
    if args.json:
        emit_json(result)
    else:
        print_table(result)
    return result
