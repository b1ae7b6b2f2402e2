"""What every command shares: the error type for bad input and the one-JSON-object output."""

from __future__ import annotations

import json
import math
import sys
from typing import Any


class CliError(Exception):
    """Bad input: `kvledger` reports it as one line on stderr and exits 2."""


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
