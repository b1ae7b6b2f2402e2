"""What the connector is told (`kv_connector_extra_config`) and the model spec its keys use.

    --kv-transfer-config '{"kv_connector": "KvledgerConnector",
                           "kv_connector_module_path": "kvledger.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"path": "/mnt/kvledger", "model": "smollm2"}}'

Keys of the extra config (all optional but one of `path` / `redis_url`):

| key           | meaning                                                                     |
|---------------|-----------------------------------------------------------------------------|
| `path`        | block ledger directory (embedded) or shared mount (cluster, with redis_url) |
| `redis_url`   | Redis of the shared index (cluster mode), e.g. redis://10.0.0.5:6379/0      |
| `model`       | an optional extra salt of every key (the weights' digest is the identity)    |
| `ttl_classes` | TTL classes in days, "agent=3,chatbot=7"                                    |
| `namespaces`  | namespace → class bindings, "tenantA=agent"                                 |
| `ttl_class`   | default class of unbound namespaces ("chatbot")                             |
| `fsync`       | fsync each stored chain (default true)                                      |
| `events`      | a JSON-lines file: one line per load, failed load and save (events.py)      |

No vLLM import here: the main test suite reads this module.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvledger.core import LayerKind, ModelSpec
from kvledger.integrations.vllm.identity import ModelIdentity
from kvledger.state.ledger import StateLedger
from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import DEFAULT_CLASS, TtlPolicy

BLOCK_SIZE = 128  # vLLM's block size under this connector: one vLLM block is one ledger block
DEFAULT_NAMESPACE = "default"  # the namespace of a request without cache_salt


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings, parsed once per process from `kv_connector_extra_config`."""

    path: str | None
    redis_url: str | None
    model: str | None
    ttl_classes: str = ""
    namespaces: str = ""
    ttl_class: str = DEFAULT_CLASS
    fsync: bool = True
    events: str | None = None
    pin_index: bool = True   # keep the embedded store's LMDB index in memory, as `kvledger serve` does (index_pin.py)
    public_prefix: str | None = None   # JSON file: published public prefixes as token-id lists (rule 12)

    def __post_init__(self) -> None:
        if self.path is None and self.redis_url is None:
            raise ValueError("kvledger connector: set kv_connector_extra_config.path (or redis_url)")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """From vLLM's `kv_connector_extra_config`; `KVLEDGER_PATH` is the fallback store path."""
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvledger connector: unknown extra config {unknown}; known: {sorted(known)}")
        extra.setdefault("path", os.environ.get("KVLEDGER_PATH"))
        extra.setdefault("redis_url", None)
        extra.setdefault("model", None)
        for flag in ("fsync", "pin_index"):   # JSON true/false, or a string from the command line
            value = extra.get(flag, True)
            extra[flag] = value if isinstance(value, bool) else str(value).lower() not in ("0", "false", "no")
        return cls(**extra)

    def policy(self) -> TtlPolicy:
        return TtlPolicy.parse(self.ttl_classes, self.namespaces, self.ttl_class)


_LEDGERS: dict[ConnectorConfig, BlockLedger] = {}


def shared_ledger(config: ConnectorConfig) -> BlockLedger:
    """One open ledger per store and process: vLLM's scheduler-side and worker-side connectors
    often live in one process (the CPU build's engine core), and a store's index opens once per process, with
    its pin (`pin_index`: an embedded store's index kept in memory while the process lives)."""
    ledger = _LEDGERS.get(config)
    if ledger is None:
        ledger = BlockLedger.open(config.path, config.redis_url, policy=config.policy(), fsync=config.fsync,
                                  pin_index=config.pin_index)
        _LEDGERS[config] = ledger
    return ledger


_STATES: dict[tuple[ConnectorConfig, str], StateLedger] = {}


def shared_state_ledger(config: ConnectorConfig, spec: ModelSpec) -> StateLedger:
    """One state ledger per store, spec and process, for a model with sliding-window layers.

    Its snapshots live only in the snapshot files beside the blocks (`<path>/snapshots/`, strategy
    `full`, no host pool, no state server): vLLM's scheduler (which asks `positions`) and its workers
    (which `put` and `fetch_into`) may be different processes, and a restarted vLLM must find them, so
    the files are the one place all of them see. Its token only keys the MACs of an in-process
    directory that stays empty (no pool publishes into it), so a fresh random one is right."""
    assert config.path is not None, "the snapshot files live beside the block store: set `path`"
    found = _STATES.get((config, spec.fingerprint()))
    if found is None:
        found = StateLedger(spec, token=secrets.token_hex(16), strategy="full", root=config.path,
                            capacity_bytes=0, serve=False, heartbeat=False).start()
        _STATES[(config, spec.fingerprint())] = found
    return found


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """The KV of one attention layer of one token under vLLM: K and V, `kv_heads` × `head_dim`, for the whole
    model (every KV head and every layer, whatever tensor or pipeline parallelism splits them over workers: a
    ledger block is the whole model's, and a worker's part of it is its `slices.KvSlice`).

    `layer_kinds` names each layer's attention in model order, FULL or SWA, and `window` is the
    sliding window in tokens, for a hybrid model under vLLM's hybrid KV cache manager; both empty
    (every layer full attention) otherwise. Invariant: window set iff some layer is SWA."""

    n_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    device: str     # vLLM's platform device type ("cpu", "cuda"): the byte layout differs per platform
    dtype: str      # the KV cache dtype's name ("bfloat16")
    layer_kinds: tuple[LayerKind, ...] = ()
    window: int | None = None

    def __post_init__(self) -> None:
        assert min(self.n_layers, self.kv_heads, self.head_dim, self.dtype_bytes) > 0
        assert not self.layer_kinds or len(self.layer_kinds) == self.n_layers, "one kind per layer"
        assert set(self.layer_kinds) <= {LayerKind.FULL, LayerKind.SWA}, "vLLM's full or sliding-window layers"
        assert (LayerKind.SWA in self.layer_kinds) == (self.window is not None), "a window iff SWA layers"

    @property
    def hybrid(self) -> bool:
        """Some layers are sliding-window layers (their KV is the state ledger's)."""
        return self.window is not None

    def count(self, kind: LayerKind) -> int:
        """Layers of `kind` (every layer is FULL when `layer_kinds` is empty)."""
        kinds = self.layer_kinds or (LayerKind.FULL,) * self.n_layers
        return kinds.count(kind)

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def spec_weights(identity: ModelIdentity, geometry: KvGeometry) -> str:
    """The spec's `weights` (which stands in its fingerprint for the name, rule 11): the model's identity (its
    weights' content, compute dtype, quantization, salt) with the platform and the KV dtype, because a block holds
    vLLM's byte layout of that platform and dtype. The fingerprint adds the rest of the geometry."""
    text = f"{identity.digest()}|{geometry.device}|{geometry.dtype}"
    return hashlib.sha256(b"kvledger/vllm-spec\0" + text.encode()).hexdigest()


def connector_spec(identity: ModelIdentity, geometry: KvGeometry) -> ModelSpec:
    """The spec salted into the keys of blocks (and snapshots) written by vLLM.

    Its fingerprint carries `spec_weights` (the weights' content, the platform, the dtypes) and the geometry
    (layers, their kinds, the window), so a key under this spec never names bytes another model or another
    byte layout computed; its name is for people (the salt or the digest's head). A hybrid geometry gives
    `hybrid_spec`'s spec.
    """
    g = geometry
    if g.hybrid:
        return hybrid_spec(identity, g)
    label = identity.salt or f"weights-{identity.weights[:12]}"
    return ModelSpec(
        name=f"vllm-{g.device}:{label}:{g.dtype}",
        layers=(LayerKind.FULL,) * g.n_layers,
        block_size=BLOCK_SIZE,
        window=None,
        backtrack=0,
        kv_bytes_per_token=g.n_layers * g.layer_token_bytes,
        indexer_bytes_per_token=0,
        swa_stored_layers=0,
        swa_bytes_per_token=0,
        description=f"{label} under vLLM on {g.device} ({g.dtype} KV)",
        weights=spec_weights(identity, g),
    )


def hybrid_spec(identity: ModelIdentity, geometry: KvGeometry) -> ModelSpec:
    """The spec of a model with full and sliding-window layers under vLLM (Gemma 3: 3 full, 15 SWA, W = 512).

    | ledger       | holds                                                   | bytes                         |
    |--------------|---------------------------------------------------------|-------------------------------|
    | block ledger | one vLLM block (128 tokens) of the full layers          | 128 × n_full × layer_token    |
    | state ledger | the window [P − W, P) of every SWA layer at a boundary P | W × n_swa × layer_token       |

    Backtrack 0 (vLLM rolls nothing back under this connector), so a snapshot is W tokens, not W + K;
    every windowed layer is in it, so R = 1 (rule 3′: a snapshot at L1 restores every window exactly).
    """
    g = geometry
    assert g.window is not None
    n_full, n_swa = g.count(LayerKind.FULL), g.count(LayerKind.SWA)
    label = identity.salt or f"weights-{identity.weights[:12]}"
    return ModelSpec(
        name=f"vllm-{g.device}:{label}:{g.dtype}",
        layers=g.layer_kinds,
        block_size=BLOCK_SIZE,
        window=g.window,
        backtrack=0,
        kv_bytes_per_token=n_full * g.layer_token_bytes,
        indexer_bytes_per_token=0,
        swa_stored_layers=n_swa,
        swa_bytes_per_token=g.layer_token_bytes,
        description=f"{label} under vLLM on {g.device} ({g.dtype} KV; {n_full} full + {n_swa} "
                    f"sliding-window layers, W = {g.window})",
        weights=spec_weights(identity, g),
    )


def namespace_of(cache_salt: str | None) -> str:
    """Rule 2: a request's `cache_salt` is its namespace; no salt is the default namespace."""
    return cache_salt if cache_salt else DEFAULT_NAMESPACE
