"""`GET /whatif` (operator only): `kvledger whatif --trace <this server's trace folder> --json`, answered as JSON.

The what-if runs in a child process (`python -m kvledger whatif`, niced), never in the server's: a simulator
run takes seconds of CPU, which inside the server would hold its interpreter lock against the requests being
served (and the simulator belongs to `bench`, above the entrypoint in the house). The recorder's queue is
flushed first, so the window ends with the last request answered. One what-if at a time: a second one while
it runs gets 429.

Query parameters are the command's flags, each passed as one `--flag=value` argument (so no value can be
read as another flag): `capacity`, `ttl`, `routing` (repeatable), `last`, `prefill_engines`. The command's
own checks decide, its bounds included (`bench/whatif_cli.py`: at most 1,024 engines, 8 values of a
repeatable parameter, 10^7 requests, 1 EB, 365 days): its one-line error comes back as a 400 whose `param`
is the parameter the line names; no trace (recording off, nothing served yet) as a 404 `no_trace`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
from typing import Any

from kvledger.entrypoint.errors import ApiError, bad_request

log = logging.getLogger("kvledger.serve")
TIMEOUT_S = 300.0   # a what-if over a large window; longer → 504
REPEATABLE = ("capacity", "ttl", "routing")
SINGLE = ("last", "prefill_engines")
NO_TRACE = ("no such file or directory", "no recorded trace here", "the recorded trace has no requests")
_running = threading.Lock()   # one what-if at a time, whichever app or loop asks
_FLAG = re.compile(r"--([a-z][a-z-]*)")


def argv(folder: str, query: list[tuple[str, str]]) -> list[str]:
    """The command line of the child for these query parameters; 400 for an unknown or repeated one."""
    args = [sys.executable, "-m", "kvledger", "whatif", "--trace", folder, "--json"]
    seen: set[str] = set()
    for name, value in query:
        if name not in REPEATABLE + SINGLE:
            raise bad_request(f"unknown parameter {name!r}; known: {', '.join(REPEATABLE + SINGLE)}", name,
                              "invalid_value")
        if name in SINGLE and name in seen:
            raise bad_request(f"{name} is given more than once", name, "invalid_value")
        seen.add(name)
        args.append(f"--{name.replace('_', '-')}={value}")
    return args


async def answer(state: Any, query: list[tuple[str, str]]) -> dict[str, Any]:
    """The what-if report of this server's own trace (see the module docstring)."""
    cmd = argv(str(state.config.trace_folder), query)
    if not _running.acquire(blocking=False):
        raise ApiError(429, "A what-if is already running on this server; retry when it ends.", "rate_limit_error",
                       None, "whatif_running")
    try:
        await asyncio.to_thread(state.trace.flush)
        done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                                       preexec_fn=_nice)
    except subprocess.TimeoutExpired:
        raise ApiError(504, f"The what-if took longer than {TIMEOUT_S:.0f} s; ask for a shorter window (last=N).",
                       "server_error", None, "whatif_timeout") from None
    finally:
        _running.release()
    if done.returncode == 0:
        return json.loads(done.stdout)
    line = (done.stderr.strip().splitlines() or [""])[-1].removeprefix("kvledger: error: ")
    if done.returncode == 2:
        if any(why in line for why in NO_TRACE):
            raise ApiError(404, f"No recorded trace to run a what-if on: {line}", "invalid_request_error", None,
                           "no_trace")
        raise bad_request(line, param_of(line), "invalid_value")
    log.error("whatif failed (exit %s): %s", done.returncode, done.stderr.strip()[-2000:])
    raise ApiError(500, "The what-if failed; the server's log has the detail.", "server_error", None, "whatif_failed")


def param_of(line: str) -> str | None:
    """The query parameter the command's error line names (its first `--flag` that is one), else None."""
    for flag in _FLAG.findall(line):
        if (name := flag.replace("-", "_")) in REPEATABLE + SINGLE:
            return name
    return None


def _nice() -> None:
    os.nice(10)
