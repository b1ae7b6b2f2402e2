"""The replay's progress bar on stderr (rich): requests done, errors, the token hit rate so far."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvledger.bench.replay_client import ReplayOutcome


@contextmanager
def progress(total: int, policy: str) -> Iterator[Callable[[ReplayOutcome], None]]:
    """Yields the callback each finished request calls (from any thread)."""
    bar = Progress(TextColumn("[bold]replay[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=False)
    task = bar.add_task(policy, total=total)
    lock = threading.Lock()
    sums = {"prompt": 0, "cached": 0, "errors": 0}

    def done(o: ReplayOutcome) -> None:
        with lock:
            sums["prompt"] += o.prompt_tokens
            sums["cached"] += o.cached_tokens
            sums["errors"] += not o.ok
            rate = sums["cached"] / sums["prompt"] if sums["prompt"] else 0.0
            bar.update(task, advance=1, description=f"{policy}  hit {rate:.3f}  errors {sums['errors']}")

    with bar:
        yield done
