"""Requests as the simulator (and a later live replay) consume them, and the Mooncake trace reader.

A Mooncake trace is JSONL, one request per line: `timestamp` (ms since the trace's start),
`input_length`, `output_length` (tokens) and `hash_ids`, the content ids of the prompt's
512-token blocks (identical ids = identical prefix up to the end of that block; the last id
may name a partial block). Lines may carry the extra keys this module writes for generated
workloads (`block_tokens`, `output_hash_ids`, `ttl_class`, `session`, `segments`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.util.output import loads_strict

MOONCAKE_BLOCK_TOKENS = 512
TTL_CLASSES = ("agent", "chatbot")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceSegment:
    """A run of `length` tokens whose ids are a pure function of `seed` (see workloads.segment_tokens)."""

    seed: int
    length: int


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. Times in seconds, lengths in tokens.

    Invariants: len(hash_ids) <= ceil(input_length / block_tokens) (ids past the end of the
    list are unknown, treated as never seen); `output_hash_ids` name the full blocks of
    prompt + output from block index input_length // block_tokens on (what decode writes,
    rule 7; empty when unknown, as in Mooncake traces); `segments`, when present, spell
    prompt + output exactly (their lengths sum to input_length + output_length).
    """

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    output_hash_ids: tuple[int, ...] = ()
    ttl_class: str = "chatbot"
    session: int = -1
    segments: tuple[TraceSegment, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        assert self.arrival_s >= 0 and self.input_length >= 0 and self.output_length >= 0
        assert self.block_tokens > 0
        assert len(self.hash_ids) <= math.ceil(self.input_length / self.block_tokens)
        assert self.ttl_class in TTL_CLASSES
        assert not self.segments or sum(s.length for s in self.segments) == self.input_length + self.output_length

    def block_len(self, i: int) -> int:
        """Prompt tokens covered by hash id i (block_tokens, or less for a partial last block)."""
        return min(self.block_tokens, self.input_length - i * self.block_tokens)

    def to_json(self) -> dict:
        """The Mooncake line for this request (extra keys only where they differ from a trace's)."""
        out: dict = {"timestamp": round(self.arrival_s * 1000, 3), "input_length": self.input_length,
                     "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.block_tokens != MOONCAKE_BLOCK_TOKENS:
            out["block_tokens"] = self.block_tokens
        if self.output_hash_ids:
            out["output_hash_ids"] = list(self.output_hash_ids)
        if self.ttl_class != "chatbot":
            out["ttl_class"] = self.ttl_class
        if self.session >= 0:
            out["session"] = self.session
        if self.segments:
            out["segments"] = [[s.seed, s.length] for s in self.segments]
        return out


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests sorted by arrival (ties keep file order), with where they came from."""

    requests: tuple[TraceRequest, ...]
    source: str

    def __post_init__(self) -> None:
        assert all(a.arrival_s <= b.arrival_s for a, b in zip(self.requests, self.requests[1:]))

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last (0 for a single request)."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def __len__(self) -> int:
        return len(self.requests)


MAX_TOKENS = 1 << 24       # input_length, output_length, block_tokens, a segment: at most this many tokens
MAX_TIMESTAMP_MS = 1e13    # about 317 years of trace


def _int(obj: dict, key: str, where: str, *, required: bool = True, default: int = 0) -> int:
    if key not in obj:
        if required:
            raise TraceError(f"{where}: missing key {key!r}")
        return default
    value = obj[key]
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or value != int(value)):
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    if value > MAX_TOKENS:
        raise TraceError(f"{where}: {key!r} is {value:.6g}, more than the limit of {MAX_TOKENS:,} tokens")
    return int(value)


def _ids(obj: dict, key: str, where: str, required: bool) -> tuple[int, ...]:
    value = obj.get(key, [] if not required else None)
    if value is None:
        raise TraceError(f"{where}: missing key {key!r}")
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise TraceError(f"{where}: {key!r} must be a list of integers")
    return tuple(value)


def parse_line(line: str, where: str) -> TraceRequest:
    """One JSONL line → TraceRequest; `TraceError` (naming `where`) for anything malformed."""
    try:
        obj = loads_strict(line)
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number of ms, got {ts!r}")
    if ts > MAX_TIMESTAMP_MS:
        raise TraceError(f"{where}: 'timestamp' is {ts:.6g} ms, more than the limit of {MAX_TIMESTAMP_MS:.0e} ms")
    length = _int(obj, "input_length", where)
    out = _int(obj, "output_length", where)
    bt = _int(obj, "block_tokens", where, required=False, default=MOONCAKE_BLOCK_TOKENS)
    if bt <= 0:
        raise TraceError(f"{where}: 'block_tokens' must be > 0")
    ids = _ids(obj, "hash_ids", where, True)
    if len(ids) > math.ceil(length / bt):
        raise TraceError(f"{where}: {len(ids)} hash_ids for {length} tokens (at most {math.ceil(length / bt)}"
                         f" blocks of {bt})")
    ttl_class = obj.get("ttl_class", "chatbot")
    if ttl_class not in TTL_CLASSES:
        raise TraceError(f"{where}: 'ttl_class' must be one of {', '.join(TTL_CLASSES)}")
    segs = obj.get("segments", [])
    try:
        segments = tuple(TraceSegment(int(s), int(n)) for s, n in segs)
        if any(not 0 < s.length <= MAX_TOKENS for s in segments):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise TraceError(f"{where}: 'segments' must be a list of [seed, length] pairs") from None
    if segments and sum(s.length for s in segments) != length + out:
        raise TraceError(f"{where}: 'segments' do not add up to input_length + output_length")
    session = obj.get("session", -1)
    if isinstance(session, bool) or not isinstance(session, int) or session < -1:
        raise TraceError(f"{where}: 'session' must be an integer >= -1")
    return TraceRequest(ts / 1000.0, length, out, ids, bt, _ids(obj, "output_hash_ids", where, False), ttl_class,
                   session, segments)


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield n, line
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None


def read_trace(path: str | Path) -> Trace:
    """Read a Mooncake-format JSONL trace; `TraceError` names the first bad line."""
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path}: is a directory")
    requests = [parse_line(line, f"{path}:{n}") for n, line in iter_lines(path)]
    if not requests:
        raise TraceError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return Trace(tuple(requests), str(path))


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write requests as Mooncake JSONL (read back by `read_trace`)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
