"""Requests as the simulator (and a later live replay) consume them, and the Mooncake trace reader.

A Mooncake trace is JSONL, one request per line: `timestamp` (ms since the trace's start),
`input_length`, `output_length` (tokens) and `hash_ids`, the content ids of the prompt's
512-token blocks (identical ids = identical prefix up to the end of that block; the last id
may name a partial block). Lines may carry the extra keys this module writes for generated
workloads (`block_tokens`, `output_hash_ids`, `ttl_class`, `session`, `segments`), and the `live`
object a server's own recorded trace adds (`LiveFigures`: what the live server measured for that
request).

Damage. `read_trace` stops at the first bad line with `TraceError` naming it (a file given by
hand: a mistake to fix). With `damage="stop"` (a trace a server recorded, which a crash or a full
disk may have cut mid-line) it keeps the requests before the bad line and says where it stopped in
`Trace.damage`.
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


class DamagedLine(TraceError):
    """One line of a trace that cannot be read (the lines before it can): the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceSegment:
    """A run of `length` tokens whose ids are a pure function of `seed` (see workloads.segment_tokens)."""

    seed: int
    length: int


@dataclass(frozen=True, slots=True)
class LiveFigures:
    """What the live server measured for a request it recorded (the `live` object of a recorded line).

    Units: tokens, bytes, seconds. `cached_tokens` are the prompt tokens it reported as cached
    (`usage.prompt_tokens_details.cached_tokens`); `ttft_s` runs from the request's arrival at the
    server to its first token (None: no token came); `engine` served its prefill (None: unknown);
    `fetch_bytes`/`fetch_s` are what its fetcher read from the store and how long that took (a hit
    from the device prefix cache reads nothing); `decode_s` runs from the first token to the last."""

    cached_tokens: int = 0
    ttft_s: float | None = None
    engine: str | None = None
    hit_kind: str = ""
    fetch_bytes: int = 0
    fetch_s: float | None = None
    decode_s: float | None = None

    def to_json(self) -> dict:
        return {"cached_tokens": self.cached_tokens, "ttft_s": self.ttft_s, "engine": self.engine,
                "hit_kind": self.hit_kind, "fetch_bytes": self.fetch_bytes, "fetch_s": self.fetch_s,
                "decode_s": self.decode_s}


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
    live: LiveFigures | None = None   # a recorded trace's: what the live server measured

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
        if self.live is not None:
            out["live"] = self.live.to_json()
        return out


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests sorted by arrival (ties keep file order), with where they came from."""

    requests: tuple[TraceRequest, ...]
    source: str
    damage: str | None = None   # `damage="stop"`: where and why reading stopped early (None: read whole)

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
    live = _live(obj["live"], length, where) if obj.get("live") is not None else None
    return TraceRequest(ts / 1000.0, length, out, ids, bt, _ids(obj, "output_hash_ids", where, False), ttl_class,
                        session, segments, live)


def _seconds(obj: dict, key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: 'live.{key}' must be a non-negative number of seconds or null, got {value!r}")
    return float(value)


def _live(obj: object, input_length: int, where: str) -> LiveFigures:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: 'live' must be a JSON object")
    cached = _int(obj, "cached_tokens", f"{where}: live", required=False)   # ≤ MAX_TOKENS
    if cached > input_length:
        raise TraceError(f"{where}: 'live.cached_tokens' is {cached}, more than the {input_length} prompt tokens")
    engine, kind = obj.get("engine"), obj.get("hit_kind", "")
    if (engine is not None and not isinstance(engine, str)) or not isinstance(kind, str):
        raise TraceError(f"{where}: 'live.engine' and 'live.hit_kind' must be strings")
    fetched = obj.get("fetch_bytes") or 0
    if isinstance(fetched, bool) or not isinstance(fetched, int) or not 0 <= fetched < 2**63:
        raise TraceError(f"{where}: 'live.fetch_bytes' must be a non-negative integer, got {fetched!r}")
    return LiveFigures(cached, _seconds(obj, "ttft_s", where), engine, kind, fetched,
                       _seconds(obj, "fetch_s", where), _seconds(obj, "decode_s", where))


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line; `TraceError` naming the file, or the line that is not
    UTF-8 (the lines before it have been yielded)."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DamagedLine(f"{path}:{n}: not UTF-8 text") from None
                if line.strip():
                    yield n, line
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None


def read_requests(path: str | Path, *, damage: str = "error") -> tuple[list[TraceRequest], str | None]:
    """The requests of one JSONL file in file order, and where reading stopped early (None: nowhere).

    `damage="error"`: the first bad line raises `TraceError` naming it. `damage="stop"`: the requests
    before it are kept, and the second value names the line and what is wrong with it. A file that
    cannot be opened raises either way."""
    assert damage in ("error", "stop")
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path}: is a directory")
    requests: list[TraceRequest] = []
    try:
        for n, line in iter_lines(path):
            try:
                requests.append(parse_line(line, f"{path}:{n}"))
            except TraceError as e:
                raise DamagedLine(str(e)) from None
    except DamagedLine as e:
        if damage == "error":
            raise
        return requests, str(e)
    return requests, None


def read_trace(path: str | Path, *, damage: str = "error") -> Trace:
    """Read a Mooncake-format JSONL trace; `TraceError` names the first bad line, or with `damage="stop"`
    the requests before it are kept (`Trace.damage` says where it stopped). No request at all is an error."""
    path = Path(path)
    requests, stopped = read_requests(path, damage=damage)
    if not requests:
        raise TraceError(f"{stopped}" if stopped else f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return Trace(tuple(requests), str(path), stopped)


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write requests as Mooncake JSONL (read back by `read_trace`)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
