"""`kvledger bench NAME --record DIR`: a run kept as a file, `DIR/<name>-<UTC time>.json` (docs/results/).

The file is the one JSON object the bench printed (`--json`), with a `run` object added: the command line,
the commit, the UTC date, and the machine it ran on (CPU model, cores, the load average before and after).
Docs quote these files; a figure in them is never edited by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvledger.util.output import CliError, emit_json


def recorded(name: str, run: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`run` (a bench's `run(args)`), its JSON also written under `args.record` when given."""

    def record_run(args: Any) -> Any:
        if not getattr(args, "record", None):
            return run(args)
        folder = Path(args.record)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"--record {folder}: {e.strerror or e}") from None
        args.json = True
        before, started, commit = os.getloadavg(), time.time(), checkout_commit()   # the code that runs: read it first
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = run(args)
        result = json.loads(out.getvalue())
        result["run"] = run_info(name, before, started, commit)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
        (folder / f"{name}-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
        emit_json(result)
        return code

    return record_run


def spread(xs: list[float], digits: int = 4) -> dict[str, float]:
    """The median of `xs` with its spread, the form every recorded figure takes: {median, min, max}."""
    assert xs, "no runs to summarize"
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits)}


def run_info(name: str, load_before: tuple[float, float, float], started: float, commit: str | None
             ) -> dict[str, Any]:
    """Where and when a run ran: what a reader needs to judge its figures. `commit`: the checkout's when the run
    started (a run takes minutes; a commit landing meanwhile is not what ran). `env`: the `KVLEDGER_*` variables
    set, which turn kernels on or off."""
    return {"bench": name, "command": "kvledger " + " ".join(sys.argv[1:]), "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": round(time.time() - started, 1),
            "cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVLEDGER_")}}   # kernel switches


def checkout_commit() -> str | None:
    """The checkout's commit (with "-dirty" when its tracked files differ), or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None
