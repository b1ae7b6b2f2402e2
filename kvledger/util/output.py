"""What every command shares: the error type for bad input and the one-JSON-object output."""

from __future__ import annotations

import json
import sys
from typing import Any


class CliError(Exception):
    """Bad input: `kvledger` reports it as one line on stderr and exits 2."""


def emit_json(obj: dict[str, Any]) -> None:
    """Print exactly one JSON object on stdout (the `--json` contract)."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()
