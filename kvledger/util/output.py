"""What every command shares: the error type for bad input, the one-JSON-object output, `--help`
(every default shown, an example in each epilog), and status lines that survive a closed pipe
(`LinePrinter`), and a Ctrl-C held over a few milliseconds of code that would report it on stderr
(`interrupts_held`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO


EXIT_INTERRUPTED = 130   # 128 + SIGINT: how a shell reports a Ctrl-C, and how every kvledger command ends on one


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """A SIGINT that lands inside the block is delivered when the block ends, to the handler that was in place.

    For a few milliseconds of someone else's code that reports any exception on stderr before it re-raises
    (prometheus_client's vendored `decorator` prints the source it was compiling), so that a Ctrl-C then
    still ends a command with its one line. Off the main thread, where Python delivers no signal, it holds
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        signal.raise_signal(signal.SIGINT)


class CliError(Exception):
    """Bad input: `kvledger` reports it as one line on stderr and exits 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """`--help` of every kvledger command: the description and the epilog's example as written, and
    each option's default appended, unless it is unset (None, False, "", []) or the help already
    places it with `%(default)s`."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not shows_default(action):
            return action.help
        return super()._get_help_string(action)


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` names this option's default: a value other than unset, off, or suppressed."""
    d = action.default
    return not (d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, (str, list)) and not d))


def examples(*commands: str) -> str:
    """An epilog of example command lines, one per line."""
    return "example" + ("s" if len(commands) > 1 else "") + ":\n" + "\n".join(f"  {c}" for c in commands)


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (an unlimited capacity, a ratio over nothing) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps_strict(obj: Any, **kw: Any) -> str:
    """Standard JSON: never `NaN` or `Infinity` (a non-finite float is written as null)."""
    return json.dumps(finite(obj), allow_nan=False, default=str, **kw)


def emit_json(obj: dict[str, Any]) -> None:
    """Print exactly one JSON object on stdout (the `--json` contract); non-finite figures are null."""
    sys.stdout.write(dumps_strict(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def finite_float(text: str) -> float:
    """An argparse type: a float that is neither nan nor ±inf."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


finite_float.__name__ = "finite number"  # argparse names the type in its message


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def loads_strict(text: str | bytes) -> Any:
    """Parse standard JSON; `ValueError` with a message for bad JSON, `NaN`/`Infinity`, or nesting
    too deep for the parser (a 100,000-deep list)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ValueError("nested too deep") from None


@dataclass(slots=True)
class LinePrinter:
    """Status lines on stdout (each flushed), for a process that must keep going when its reader leaves
    (`kvledger up | head -n 2`). The first write that fails (EPIPE: the pipe's reader closed it; EIO: a
    hung-up terminal) turns the printer into a sink: every later line is dropped, nothing raises, and
    stdout points at /dev/null, so the interpreter's last flush cannot fail either. `gone` says the
    reader has left (the caller may stop).

    `reader_left()` finds a closed pipe without writing (poll: POLLERR on a pipe whose reader closed,
    POLLHUP on a hung-up terminal); once true, the printer is a sink too."""

    stream: TextIO = field(default_factory=lambda: sys.stdout)
    gone: bool = False

    def line(self, text: str) -> None:
        if self.gone:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError, AttributeError):   # EPIPE, EIO; a closed (ValueError) or absent stdout
            self._sink()

    def reader_left(self) -> bool:
        if not self.gone:
            with contextlib.suppress(OSError, ValueError, AttributeError):   # no descriptor: only writes tell
                poller = select.poll()
                poller.register(self.stream.fileno(), 0)   # 0: only POLLERR, POLLHUP, POLLNVAL come back
                if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
                    self._sink()
        return self.gone

    def _sink(self) -> None:
        self.gone = True
        to_devnull(self.stream)


def to_devnull(stream: TextIO) -> None:
    """Point `stream`'s file descriptor at /dev/null: what is still buffered, and what comes, goes nowhere
    (after EPIPE, so that the interpreter's last flush does not fail again)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
