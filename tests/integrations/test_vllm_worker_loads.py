"""The worker side's loads run beside the forward (engine/swapin.py's copier): `start_load_kv` returns
before the blocks are read, each layer waits only for itself, a load that never arrives is reported
and recomputed instead of hanging the engine, and host rows are reused across steps. A real block
ledger on disk; the slow or stuck store is that ledger behind a gate the test opens."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvledger.integrations.vllm import worker as worker_mod
from kvledger.integrations.vllm.layout import KvLayout, layer_index
from kvledger.integrations.vllm.records import StepPlan
from kvledger.store.ledger import BlockLedger
from tests.integrations.test_vllm_sides import B, GEOMETRY, NUM_BLOCKS, cpu_caches, forward, request, run_of, worker


class GatedLedger(BlockLedger):
    """The real ledger, whose reads start only once `gate` is set (or `hold_s` has passed)."""

    def __init__(self, inner: BlockLedger, hold_s: float) -> None:
        super().__init__(inner.store, inner.policy)
        self.gate = threading.Event()
        self.hold_s = hold_s
        self.reading = threading.Event()
        self.read = threading.Event()

    def read_prefix(self, keys, bufs):  # noqa: ANN001, ANN201 - BlockLedger's signature
        self.reading.set()
        self.gate.wait(self.hold_s)
        try:
            return super().read_prefix(keys, bufs)
        finally:
            self.read.set()


@pytest.fixture
def ledger(tmp_path):
    with BlockLedger.open(tmp_path / "store", fsync=False) as led:
        yield led


def saved(ledger: BlockLedger, seed: int, ids: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], object]:
    src = cpu_caches(seed)
    req = request(f"r{seed}", 4 * B + 5, seed=seed)
    assert forward(worker(ledger, src), StepPlan(saves=(run_of(req, 0, ids),)), sorted(src)) == set()
    return src, req


def test_start_load_returns_before_the_read_and_each_layer_waits_for_its_copy(ledger):
    src, req = saved(ledger, 1, (3, 5, 6))
    gated = GatedLedger(ledger, hold_s=5)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    side = worker(gated, dst)
    names = sorted(src, key=layer_index)
    side.start_step(StepPlan(loads=(run_of(req, 0, (7, 8, 9)),)))
    assert not gated.read.is_set()  # start_load_kv returned with the read pending
    assert gated.reading.wait(10)
    assert not any(t.any() for t in dst.values())
    gated.gate.set()
    for name in names:
        side.layer_loaded(name)
        assert torch.equal(dst[name][7:10], src[name][[3, 5, 6]])
    side.finish_step()
    assert side.take_failed() == set()


def test_a_load_that_never_arrives_is_reported_not_waited_for_nor_copied_late(ledger, monkeypatch):
    monkeypatch.setattr(worker_mod, "LOAD_WAIT_S", 0.3, raising=False)
    src, req = saved(ledger, 2, (0, 1))
    gated = GatedLedger(ledger, hold_s=3.0)  # the store answers, but long after the layer gave up
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    side = worker(gated, dst)
    plan = StepPlan(loads=(run_of(req, 0, (4, 5)),), saves=(run_of(req, 2, (6,)),))
    staging = side.load_rows
    t0 = time.perf_counter()
    failed = forward(side, plan, sorted(src))
    assert failed == {4, 5} and time.perf_counter() - t0 < 2.5
    assert side.load_rows is not staging  # the next step reads into rows the late read cannot touch
    time.sleep(3.0)  # the read ends now: its blocks must not reach vLLM's cache after the step
    assert not any(t.any() for t in dst.values())
    gated.hold_s = 0
    assert forward(side, StepPlan(loads=(run_of(req, 0, (4, 5)),)), sorted(src)) == set()  # the next step loads
    assert all(torch.equal(dst[name][4:6], src[name][0:2]) for name in src)
    assert ledger.exists(run_of(req, 2, (6,)).keys) == [False]  # computed on lost KV: not saved


def test_host_rows_are_reused_across_steps(ledger):
    src, req = saved(ledger, 3, (1, 2))
    side = worker(ledger, {k: torch.zeros_like(v) for k, v in src.items()})
    ptrs = set()
    for _ in range(3):
        assert forward(side, StepPlan(loads=(run_of(req, 0, (8, 9)),)), sorted(src)) == set()
        ptrs.add(side.load_rows.buf.data_ptr())
    assert len(ptrs) == 1


def test_a_layout_whose_blocks_are_not_contiguous_round_trips():
    """K and V apart ([2, num_blocks, ...], the layout of some GPU backends): no flat view, same bytes."""
    g = torch.Generator().manual_seed(4)
    shape = (2, NUM_BLOCKS, B, GEOMETRY.kv_heads, GEOMETRY.head_dim)
    caches = {f"layers.{i}.attn": torch.randn(shape, generator=g).to(torch.bfloat16) for i in range(3)}
    layout = KvLayout(caches, NUM_BLOCKS, B * GEOMETRY.layer_token_bytes)
    assert all(layer.blocks is None for layer in layout.layers)
    rows = torch.empty((2, layout.block_bytes), dtype=torch.uint8)
    for name in layout.names:
        layout.gather(name, (3, 7), rows)
    out = {k: torch.zeros_like(v) for k, v in caches.items()}
    back = KvLayout(out, NUM_BLOCKS, B * GEOMETRY.layer_token_bytes)
    for name in back.names:
        back.scatter(name, rows, (1, 2))
        assert torch.equal(out[name][:, 1:3], caches[name][:, [3, 7]])
