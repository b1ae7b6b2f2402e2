"""`KvledgerConnector`: kvledger's two ledgers as a vLLM v1 KV connector (`SupportsHMA`).

vLLM builds two instances: one in the scheduler (`SchedulerSide`: CHECK, step plans) and one
per worker (`WorkerSide`: loads and saves). Both open the same ledger (a directory shared by
every engine, or the cluster mode's Redis index and mount) and derive the same model spec, so
keys agree across processes, engines and restarts. This class only adapts vLLM's calls; the
rules are in the two sides, `kvledger.core` and `kvledger.store`.

Requires vLLM's block size to be 128 (`--block-size 128`): one vLLM block is one ledger block.

With vLLM's hybrid KV cache manager on (it stays on: the connector is `SupportsHMA`), a model with
sliding-window layers (Gemma 3) has several KV cache groups: the full-attention group's blocks go
to the block ledger, the sliding-window groups' window at a block boundary to the state ledger
(snapshot files beside the blocks). A full-attention model is one group and runs as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvledger.core import LayerKind
from kvledger.integrations.vllm.config import (
    BLOCK_SIZE,
    ConnectorConfig,
    KvGeometry,
    connector_spec,
    shared_ledger,
    shared_state_ledger,
)
from kvledger.integrations.vllm.events import event_log
from kvledger.integrations.vllm.identity import model_identity
from kvledger.integrations.vllm.layout import KvLayout, layer_index
from kvledger.integrations.vllm.records import KvGroups, StepPlan
from kvledger.integrations.vllm.scheduler import SchedulerSide
from kvledger.integrations.vllm.slices import KvSlice, Slicing, engine_slices, first_replica, head_range
from kvledger.integrations.vllm.worker import WorkerSide
from kvledger.util.public_prefix import load_public_prefixes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvledger.vllm")


@dataclass(frozen=True, slots=True)
class KvledgerMetadata(KVConnectorMetadata):
    """One step's plan, as vLLM carries it from the scheduler to the workers."""

    plan: StepPlan


def group_kinds(kv_cache_config: KVCacheConfig) -> list[LayerKind]:
    """Each KV cache group's kind: FULL (full attention) or SWA (sliding window); ValueError for any
    other (Mamba state, chunked-local attention, MLA …), whose KV the ledgers do not model."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if type(spec) is FullAttentionSpec:
            kinds.append(LayerKind.FULL)
        elif type(spec) is SlidingWindowSpec:
            kinds.append(LayerKind.SWA)
        else:
            raise ValueError(f"kvledger connector: KV cache group of {type(spec).__name__} "
                             f"({len(g.layer_names)} layers) is not supported (full attention and sliding "
                             "windows only)")
    if kinds.count(LayerKind.FULL) != 1:
        raise ValueError(f"kvledger connector: needs exactly one full-attention KV cache group, got {kinds}")
    return kinds


def geometry_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[KvGeometry, KvGroups]:
    """The KV geometry of the whole model (every KV head, every layer; the same in the scheduler and every worker
    of any parallelism) and the groups, from vLLM's configs. A worker's cache config holds its own heads and its
    own stage's layers; the scheduler's is the first worker's."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    model = vllm_config.model_config
    total_heads = model.get_total_num_kv_heads()
    groups = kv_cache_config.kv_cache_groups
    kinds = group_kinds(kv_cache_config)
    specs = [g.kv_cache_spec for g in groups]
    shapes = {(s.num_kv_heads, s.head_size, s.dtype) for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"kvledger connector: every layer must have the same KV shape; got {sorted(map(str, shapes))}")
    if any(s.block_size != BLOCK_SIZE for s in specs):
        raise ValueError(f"kvledger connector needs vLLM's block size {BLOCK_SIZE}; got "
                         f"{sorted({s.block_size for s in specs})} (start vLLM with --block-size {BLOCK_SIZE})")
    windows = {s.sliding_window for s, k in zip(specs, kinds) if k is LayerKind.SWA}
    if len(windows) > 1:
        raise ValueError(f"kvledger connector: one sliding window for all layers; got {sorted(windows)}")
    kind_of = {name: k for g, k in zip(groups, kinds) for name in g.layer_names}
    names = sorted(kind_of, key=layer_index)
    spec = specs[0]
    hybrid = LayerKind.SWA in kinds
    if spec.num_kv_heads != max(1, total_heads // tp):
        raise ValueError(f"kvledger connector: {spec.num_kv_heads} KV heads per worker, expected max(1, "
                         f"{total_heads} // {tp}) (vLLM's split of the model's KV heads)")
    if hybrid and pp > 1:
        raise ValueError("kvledger connector: a model with sliding-window layers runs without pipeline "
                         "parallelism (its window snapshots are not sliced by layer)")
    n_layers = model.get_total_num_hidden_layers() if pp > 1 else len(names)
    geometry = KvGeometry(n_layers=n_layers, kv_heads=total_heads, head_dim=spec.head_size,
                          dtype_bytes=torch.empty((), dtype=spec.dtype).element_size(),
                          device=str(current_platform.device_type), dtype=str(spec.dtype).removeprefix("torch."),
                          layer_kinds=tuple(kind_of[n] for n in names) if hybrid else (),
                          window=windows.pop() if hybrid else None)
    return geometry, KvGroups(kinds.index(LayerKind.FULL),
                              tuple(i for i, k in enumerate(kinds) if k is LayerKind.SWA))


def slicing_of(vllm_config: VllmConfig, geometry: KvGeometry, layer_names: list[str], *, worker: bool) -> Slicing:
    """The engine's slices of a block under its tensor and pipeline parallelism (`slices.py`), and a worker's own
    (its TP rank's heads, its stage's layers, whose names `layer_names` are). A model with sliding-window layers
    runs only where every worker holds the whole block (its window snapshots are not sliced): no parallelism, or
    tensor parallelism over one KV head (replicated; stored by the first worker)."""
    g = geometry
    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    head_bytes = BLOCK_SIZE * 2 * g.head_dim * g.dtype_bytes
    n_full = g.count(LayerKind.FULL)   # a block's layers (every layer but a hybrid model's windowed ones)
    if tp == pp == 1:
        return Slicing.whole(g.kv_heads, n_full, head_bytes)
    from vllm.distributed.utils import get_pp_indices

    stages = tuple(get_pp_indices(n_full, r, pp) for r in range(pp))   # pp > 1: no windowed layers
    engine = engine_slices(g.kv_heads, tp, stages)
    if g.hybrid and len(engine) > 1:
        raise ValueError(f"kvledger connector: a model with sliding-window layers needs every worker to hold the "
                         f"whole block; {g.kv_heads} KV heads split over {tp} workers do not (its window snapshots "
                         "are not sliced)")
    if not worker:
        return Slicing(g.kv_heads, n_full, head_bytes, engine)
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    rank, stage = get_tensor_model_parallel_rank(), stages[get_pp_group().rank_in_group]
    layers = sorted(layer_index(n)[0] for n in layer_names)
    if pp > 1 and layers != list(range(*stage)):
        raise ValueError(f"kvledger connector: this worker's layers {layers[:3]}…{layers[-3:]} are not its "
                         f"stage's [{stage[0]}, {stage[1]})")
    own = KvSlice(*head_range(g.kv_heads, rank, tp), *stage)
    return Slicing(g.kv_heads, n_full, head_bytes, engine, own, first_replica(g.kv_heads, rank, tp))


class KvledgerConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector over kvledger's ledgers (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.config = ConnectorConfig.from_extra(extra)
        identity = model_identity(vllm_config.model_config, vllm_config.load_config, self.config.model)
        self.geometry, self.groups = geometry_of(vllm_config, kv_cache_config)
        self.spec = connector_spec(identity, self.geometry)
        full_layers = kv_cache_config.kv_cache_groups[self.groups.full].layer_names
        self.slicing = slicing_of(vllm_config, self.geometry, full_layers,
                                  worker=role != KVConnectorRole.SCHEDULER)
        ledger = shared_ledger(self.config)
        state = shared_state_ledger(self.config, self.spec) if self.spec.has_swa else None
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            public = (load_public_prefixes(Path(self.config.public_prefix), None, None, BLOCK_SIZE)
                      if self.config.public_prefix else None)
            self.scheduler_side = SchedulerSide(ledger, self.spec, state=state, groups=self.groups,
                                                slicing=self.slicing, public=public)
            log.warning("kvledger connector: store %s, keys of model %r (weights %s, fingerprint %s); KV cache "
                        "groups: full %d → block ledger, sliding-window %s → state ledger (W = %s)",
                        self.config.path or self.config.redis_url, self.spec.name, identity.weights,
                        self.spec.fingerprint(),
                        self.groups.full, list(self.groups.windows) or "none", self.spec.window)
            log.warning("kvledger connector: %d KV heads × %d layers a block, held as %d slices %s",
                        self.slicing.kv_heads, self.slicing.n_layers, len(self.slicing.engine),
                        [(s.head0, s.head1, s.layer0, s.layer1) for s in self.slicing.engine])
        else:
            self.worker_side = WorkerSide(ledger, event_log(self.config), state, self.slicing)

    # --- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        n = self.scheduler_side.matched_tokens(request, num_computed_tokens)
        return n, n > 0 and self.scheduler_side.loads_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        ids = blocks.get_block_ids() if num_external_tokens and self.scheduler_side.loads_async else None
        self.scheduler_side.after_alloc(request, num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return KvledgerMetadata(self.scheduler_side.plan_step(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.note_failed(connector_output.invalid_block_ids)
            self.scheduler_side.note_failed_requests(connector_output.failed_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return False, self.scheduler_side.finished(request.request_id)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Never delays the free: every save (blocks and windows) was copied out in the step that computed it."""
        return self.request_finished(request, [])

    # --- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None and self.slicing.own is not None
        layer_bytes = self.slicing.own.heads * self.slicing.head_bytes   # this worker's heads of one layer
        num_blocks = self._kv_cache_config.num_blocks
        groups = self._kv_cache_config.kv_cache_groups
        full = {n: kv_caches[n] for n in groups[self.groups.full].layer_names}
        layout = KvLayout(full, num_blocks, layer_bytes)
        assert layout.block_bytes == self.slicing.part_bytes(self.slicing.own), "a worker's part of a block"
        window_group = {n: i for i, g in enumerate(self.groups.windows) for n in groups[g].layer_names}
        windows = KvLayout({n: kv_caches[n] for n in window_group}, num_blocks, layer_bytes) if window_group else None
        self.worker_side.register(layout, windows, window_group)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvledgerMetadata)
        self.worker_side.start_step(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker_side is not None
        self.worker_side.layer_loaded(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker_side is not None
        self.worker_side.layer_computed(layer_name)

    def wait_for_save(self) -> None:
        assert self.worker_side is not None
        self.worker_side.finish_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid model's loads, per request: each load that ended, and those that failed (also ended)."""
        if self.worker_side is None:
            return KVConnectorTransferResults()
        done, failed = self.worker_side.take_transfer_results()
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed() if self.worker_side is not None else set()
