"""A server's own recorded trace, as `kvledger whatif` reads it: the rotated files of its trace folder, the
settings it was started with, and what it measured over the window.

    DATA_DIR/trace/requests.<N>.jsonl ... requests.1.jsonl, requests.jsonl   (entrypoint/trace_recorder.py)
    DATA_DIR/trace/server.json                                              (model, TTLs, capacity, routing)

`--trace` may name the data directory, its trace folder, or one JSONL file. Every file is read up to its
first damaged line (a crash or a full disk may cut the last one), each damage becoming a warning that
names the line. Arrival times are rebased so the window starts at 0 (the recorder writes epoch ms).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvledger.bench.sim_core import percentile
from kvledger.bench.trace import Trace, TraceError, TraceRequest, read_requests

TRACE_FOLDER = "trace"
SETTINGS = "server.json"


@dataclass(frozen=True, slots=True)
class Recorded:
    """The window a what-if runs on. `trace`: its requests, sorted, the first arriving at 0 s; `server`: the
    server's settings (`server.json`; {} when absent); `start_epoch_s`: the first arrival's wall time;
    `warnings`: one line per damaged file (`FILE:LINE: why`)."""

    trace: Trace
    server: dict[str, Any]
    start_epoch_s: float
    warnings: tuple[str, ...] = ()


def trace_files(path: Path) -> list[Path]:
    """The JSONL files of `path` (a data directory, a trace folder, or one file), oldest first; [] when none."""
    if path.is_file():
        return [path]
    folder = path / TRACE_FOLDER if (path / TRACE_FOLDER).is_dir() else path
    if not folder.is_dir():
        return []

    def age(p: Path) -> int:   # requests.jsonl is the newest (0), requests.K.jsonl the K-th before it
        middle = p.name.removeprefix("requests").removesuffix(".jsonl").strip(".")
        return int(middle) if middle.isdigit() else 0

    return sorted((p for p in folder.glob("requests*.jsonl") if p.is_file()), key=age, reverse=True)


def load_recorded(path: str | Path, last: int | None = None) -> Recorded:
    """The recorded window at `path` (its last `last` requests when given). `TraceError` with one line when there
    is no trace there, or no request in it."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory (give a server's --data-dir, its trace folder, or a "
                         "trace file)")
    files = trace_files(path)
    if not files:
        raise TraceError(f"{path}: no recorded trace here (requests*.jsonl in {path / TRACE_FOLDER}); was the server "
                         "started with --no-trace?")
    requests: list[TraceRequest] = []
    warnings: list[str] = []
    for f in files:
        got, damage = read_requests(f, damage="stop")
        requests += got
        if damage is not None:
            warnings.append(f"{damage}; read the {len(got)} requests before it")
    if not requests:
        raise TraceError(f"{path}: the recorded trace has no requests" + (f" ({warnings[0]})" if warnings else ""))
    requests.sort(key=lambda r: r.arrival_s)
    if last is not None:
        requests = requests[-last:]
    t0 = requests[0].arrival_s
    rebased = tuple(replace(r, arrival_s=r.arrival_s - t0) for r in requests)
    return Recorded(Trace(rebased, str(path)), _settings(files[-1].parent), t0, tuple(warnings))


def _settings(folder: Path) -> dict[str, Any]:
    try:
        obj = json.loads((folder / SETTINGS).read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def live_figures(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """What the live server measured over the window (requests recorded without live figures are left out).
    Rates in [0, 1]: `token_hit_rate` = Σ cached / Σ prompt tokens, `block_hit_rate` = Σ cached blocks /
    Σ hash ids (as the simulator counts them); TTFT in seconds."""
    live = [r for r in requests if r.live is not None]
    prompt = sum(r.input_length for r in live)
    cached = sum(r.live.cached_tokens for r in live)
    refs = sum(len(r.hash_ids) for r in live)
    hit_blocks = sum(min(r.live.cached_tokens / r.block_tokens, len(r.hash_ids)) for r in live)
    ttft = [r.live.ttft_s for r in live if r.live.ttft_s is not None]
    engines = sorted({r.live.engine or "embedded" for r in live})
    return {"requests": len(live), "prompt_tokens": prompt, "cached_tokens": cached,
            "token_hit_rate": cached / prompt if prompt else 0.0, "block_hit_rate": hit_blocks / refs if refs else 0.0,
            "ttft_p50_s": percentile(ttft, 50) if ttft else None, "ttft_p99_s": percentile(ttft, 99) if ttft else None,
            "engines": engines, "span_s": requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0}


def ttl_seconds(server: dict[str, Any]) -> dict[str, float] | None:
    """The server's TTL seconds per class (server.json), or None when it does not say (then nothing expires)."""
    ttl = server.get("ttl_s")
    if not isinstance(ttl, dict):
        return None
    out = {k: float(v) for k, v in ttl.items() if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}
    return out or None
