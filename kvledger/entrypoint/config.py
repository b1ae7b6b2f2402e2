"""What `kvledger serve` and `kvledger entrypoint` are started with (`ServeConfig`); its defaults are
`engine.defaults.DEFAULTS`, which the commands' flags read too.

A light module (no engine, no torch): the CLIs read it for `--help` before anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.engine.defaults import DEFAULTS
from kvledger.engine.ledgers import Part
from kvledger.engine.models import registry
from kvledger.entrypoint.body_limit import BODY_TIMEOUT_S
from kvledger.store.quota import Owner
from kvledger.store.ttl import DEFAULT_CLASSES
from kvledger.util.paths import default_data_dir
from kvledger.util.units import format_duration, parse_duration


def per_key_default(max_num_seqs: int, keyed: bool) -> int:
    """The default --max-concurrent-per-key. With a key file: half of one engine's batch (at least 1), so one
    key never fills the batch, and another tenant's request is admitted at the next step rather than after one
    of the flood's requests (each up to --max-tokens-limit tokens) ends. Without one every caller is the same
    tenant, with no other to starve: `DEFAULTS.open_per_key`."""
    return max(1, max_num_seqs // 2) if keyed else DEFAULTS.open_per_key



def parse_ttl_classes(text: str, base: Mapping[str, float] = DEFAULT_CLASSES) -> dict[str, float]:
    """`--ttl-classes`: 'agent=30s,chatbot=2m' (durations with units; a class not named keeps its TTL in
    `base`) or '45s' (every class) → TTL seconds of every class of `base`. ValueError naming what is wrong."""
    out = dict(base)
    if "=" not in text:
        return dict.fromkeys(out, parse_duration(text))
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name.strip() not in out:
            raise ValueError(f"unknown TTL class {name.strip()!r}; known: {', '.join(sorted(out))}")
        out[name.strip()] = parse_duration(value)
    return out


DEFAULT_TTL_CLASSES = ",".join(f"{k}={format_duration(v)}" for k, v in DEFAULT_CLASSES.items())   # agent=3d,...


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """The server's own trace (entrypoint/trace_recorder.py). On by default. On disk at most
    (files + 1) × file_bytes: the current file and `files` rotated ones, each rotated before a line
    would take it past `file_bytes` (a single line longer than that is dropped). `folder` None: the
    data directory's `trace/`."""

    enabled: bool = True
    file_bytes: int = DEFAULTS.trace_file_bytes
    files: int = DEFAULTS.trace_files
    folder: Path | None = None

    def __post_init__(self) -> None:
        assert self.file_bytes > 0 and self.files >= 0


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `kvledger serve` (or `kvledger entrypoint`) was started with. Limits are per request unless named
    otherwise. `part` is the mode, chosen once by the command: EMBEDDED (`serve`: the engine in this process, the
    store local) or ENTRYPOINT (a cluster's front: engines elsewhere, the index in Redis); no other code infers it.
    Invariant: the entrypoint has a Redis URL and a cluster token, the embedded server neither."""

    part: Part = Part.EMBEDDED
    model: str = registry.DEFAULT_MODEL   # a registry name or a path (`registry.resolve`)
    host: str = DEFAULTS.host
    port: int = DEFAULTS.port
    data_dir: Path = field(default_factory=default_data_dir)
    api_keys: Path | None = None
    public_prefix: Path | None = None  # published public prefixes (entrypoint/public_prefix.py, rule 12)
    no_cache: bool = False             # every request computes its whole prompt (bench baseline)
    max_body_bytes: int = DEFAULTS.max_body_bytes
    body_timeout_s: float = BODY_TIMEOUT_S   # the whole body in within this long of the headers, else 408
    max_concurrent_per_key: int = DEFAULTS.open_per_key   # running + waiting requests of one key; more → 429
    default_max_tokens: int = 256      # chat requests that name no limit
    max_prompt_tokens: int | None = None   # None: the model's context minus one
    max_tokens_limit: int | None = DEFAULTS.max_tokens_limit   # None: what the context leaves after the prompt
    max_num_seqs: int = DEFAULTS.max_num_seqs
    status_every_s: float = DEFAULTS.status_interval_s   # a status line per this many seconds of activity; 0: none
    device: str = DEFAULTS.device
    replay: bool = False
    checkpoint_every: int = DEFAULTS.checkpoint_every    # rule 4′: a snapshot every this many prompt tokens (0: none)
    ttl_classes: Mapping[str, float] | None = None   # TTL seconds per class (None: the store's, 3 and 7 days)
    store_capacity_bytes: int | None = None   # the block ledger: LRU eviction past this (None: unlimited)
    quota_flags: tuple[tuple[Owner, int], ...] = ()   # `--quota` (store/quota.py; resolved with the key file's)
    gc_interval_s: float = DEFAULTS.gc_interval_s   # embedded: expired blocks removed this often (0: never)
    kv_cache_bytes: int | None = None      # embedded: the engine's device KV pool (None: the engine's default)
    stream_hits: bool | None = None        # embedded: `Engine(stream_hits=...)`; None: the engine's default
    trace: TraceSettings = field(default_factory=TraceSettings)
    # cluster mode (`kvledger entrypoint`): no engine here; Redis holds the index, the directory and
    # the engine registry, and the engines are reached with the cluster token
    redis_url: str | None = None
    cluster_token: str | None = field(default=None, repr=False)
    routing: str = DEFAULTS.routing
    tail_handoff: bool = True              # P/D: the decode leg pulls the prompt's tail from the prefill engine

    def __post_init__(self) -> None:
        registry.resolve(self.model)   # ModelError (a ValueError) names what is served
        assert self.part in (Part.EMBEDDED, Part.ENTRYPOINT), self.part
        assert (self.part is Part.EMBEDDED) == (self.redis_url is None) == (self.cluster_token is None), \
            "the entrypoint has a Redis URL and a cluster token, the embedded server neither"
        assert self.max_body_bytes > 0 and self.max_concurrent_per_key > 0 and self.default_max_tokens > 0
        assert self.body_timeout_s > 0
        assert self.store_capacity_bytes is None or self.store_capacity_bytes > 0
        assert self.gc_interval_s >= 0

    @property
    def embedded(self) -> bool:
        return self.part is Part.EMBEDDED

    def device_pool(self) -> dict[str, int]:
        """The embedded engine's device pool arguments: `kv_cache_bytes` when set, with the longest request this
        server's limits admit (prompt + output), so a pool smaller than the model's context can hold one."""
        if self.kv_cache_bytes is None:
            return {}
        out = {"kv_cache_bytes": self.kv_cache_bytes}
        if self.max_prompt_tokens is not None and self.max_tokens_limit is not None:
            out["max_seq_tokens"] = self.max_prompt_tokens + self.max_tokens_limit
        return out

    @property
    def trace_folder(self) -> Path:
        """Where the server's own trace goes (`TraceSettings.folder`, else `<data_dir>/trace`)."""
        return self.trace.folder or Path(self.data_dir) / "trace"
