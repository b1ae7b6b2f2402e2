"""`KvledgerConnector`: kvledger's block ledger as a vLLM v1 KV connector.

vLLM builds two instances: one in the scheduler (`SchedulerSide`: CHECK, step plans) and one
per worker (`WorkerSide`: loads and saves). Both open the same ledger (a directory shared by
every engine, or the cluster mode's Redis index and mount) and derive the same model spec, so
keys agree across processes, engines and restarts. This class only adapts vLLM's calls; the
rules are in the two sides, `kvledger.core` and `kvledger.store`.

Requires vLLM's block size to be 128 (`--block-size 128`): one vLLM block is one ledger block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvledger.integrations.vllm.config import BLOCK_SIZE, ConnectorConfig, KvGeometry, connector_spec, shared_ledger
from kvledger.integrations.vllm.layout import KvLayout
from kvledger.integrations.vllm.records import StepPlan
from kvledger.integrations.vllm.scheduler import SchedulerSide
from kvledger.integrations.vllm.worker import WorkerSide

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


def geometry_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KvGeometry:
    """The KV geometry from vLLM's cache config (the same in the scheduler and the workers)."""
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    shapes = {(g.kv_cache_spec.num_kv_heads, g.kv_cache_spec.head_size, g.kv_cache_spec.dtype) for g in groups
              if hasattr(g.kv_cache_spec, "num_kv_heads")}
    if len(shapes) != 1 or not all(hasattr(g.kv_cache_spec, "num_kv_heads") for g in groups):
        raise ValueError("kvledger connector: every layer must have the same KV shape (attention layers only; "
                         f"got {sorted(map(str, shapes))}); for sliding-window models start vLLM with "
                         "--disable-hybrid-kv-cache-manager")
    if spec.block_size != BLOCK_SIZE:
        raise ValueError(f"kvledger connector needs vLLM's block size {BLOCK_SIZE}; got {spec.block_size} "
                         f"(start vLLM with --block-size {BLOCK_SIZE})")
    n_layers = sum(len(g.layer_names) for g in groups)
    dtype = spec.dtype
    return KvGeometry(n_layers=n_layers, kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                      dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                      device=str(current_platform.device_type), dtype=str(dtype).removeprefix("torch."))


class KvledgerConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvledger's block ledger (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.config = ConnectorConfig.from_extra(extra)
        model = self.config.model or vllm_config.model_config.served_model_name
        self.geometry = geometry_of(vllm_config, kv_cache_config)
        self.spec = connector_spec(str(model), self.geometry)
        ledger = shared_ledger(self.config)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(ledger, self.spec)
            log.warning("kvledger connector: hybrid KV caching is off (full-attention KV only, "
                        "no sliding-window snapshots); store %s, keys of model %r (fingerprint %s)",
                        self.config.path or self.config.redis_url, self.spec.name, self.spec.fingerprint())
        else:
            self.worker_side = WorkerSide(ledger, self.config.events)

    # --- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return KvledgerMetadata(self.scheduler_side.plan_step(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.note_failed(connector_output.invalid_block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return False, self.scheduler_side.finished(request.request_id)

    # --- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        layer_bytes = BLOCK_SIZE * self.geometry.layer_token_bytes
        layout = KvLayout(kv_caches, self._kv_cache_config.num_blocks, layer_bytes)
        assert layout.block_bytes == self.spec.block_bytes(), "a ledger block is all layers of one vLLM block"
        self.worker_side.register(layout)

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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed() if self.worker_side is not None else set()
