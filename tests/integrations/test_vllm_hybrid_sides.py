"""The connector's two sides for a hybrid model, without vLLM: a real block ledger and a real state ledger
(snapshot files) on disk, KV caches as torch tensors in vLLM's CPU layout, three KV cache groups as vLLM's
hybrid manager makes them (here: group 0 and 2 sliding-window, W = 2 blocks; group 1 full attention).
vLLM itself is exercised by test_vllm_gemma3.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvledger.core import LayerKind, chain_keys
from kvledger.integrations.vllm.config import ConnectorConfig, KvGeometry, connector_spec, shared_state_ledger
from kvledger.integrations.vllm.identity import ModelIdentity
from kvledger.integrations.vllm.layout import KvLayout
from kvledger.integrations.vllm.records import KvGroups, StepPlan
from kvledger.integrations.vllm.scheduler import SchedulerSide
from kvledger.integrations.vllm.worker import WorkerSide
from kvledger.state.files import SnapshotFiles
from kvledger.store.ledger import BlockLedger
from tests.integrations.test_vllm_sides import B, request, step

W = 2 * B
NUM_BLOCKS = 80   # group g of the tests uses blocks 10·g … (loads: 40 + …)
KINDS = (LayerKind.SWA, LayerKind.FULL, LayerKind.SWA)   # layer i is in group i
GEOMETRY = KvGeometry(3, 2, 8, 2, "cpu", "bfloat16", KINDS, W)
IDENTITY = ModelIdentity("cd" * 32, "bfloat16", salt="tiny-hybrid")   # weights of no file: never read here
SPEC = connector_spec(IDENTITY, GEOMETRY)
GROUPS = KvGroups(full=1, windows=(0, 2))
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


@pytest.fixture
def ledgers(tmp_path: Path):
    config = ConnectorConfig.from_extra({"path": str(tmp_path / "store"), "fsync": False})
    with BlockLedger.open(config.path, fsync=False) as ledger:
        yield ledger, shared_state_ledger(config, SPEC)


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, GEOMETRY.kv_heads, B, 2 * GEOMETRY.head_dim)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name in NAMES}


def worker(ledgers, kv: dict[str, torch.Tensor]) -> WorkerSide:
    ledger, state = ledgers
    side = WorkerSide(ledger, None, state)
    layer_bytes = B * GEOMETRY.layer_token_bytes
    side.register(KvLayout({NAMES[1]: kv[NAMES[1]]}, NUM_BLOCKS, layer_bytes),
                  KvLayout({NAMES[0]: kv[NAMES[0]], NAMES[2]: kv[NAMES[2]]}, NUM_BLOCKS, layer_bytes),
                  {NAMES[0]: 0, NAMES[2]: 1})
    return side


def forward(side: WorkerSide, plan: StepPlan) -> tuple[set[str], set[str]]:
    side.start_step(plan)
    for name in NAMES:
        side.layer_loaded(name)
        side.layer_computed(name)
    side.finish_step()
    assert side.take_failed() == set(), "a hybrid model's failures are never block ids"
    return side.take_transfer_results()


def ids(first: int, n: int = 8) -> list[int]:
    return list(range(first, first + n))


def test_spec_is_hybrid_with_r_1_and_a_window_of_w_tokens():
    assert SPEC.has_swa and SPEC.reserve_tokens == 1 and SPEC.layers == KINDS
    assert SPEC.block_bytes() == B * GEOMETRY.layer_token_bytes
    assert SPEC.state_size_to_disk() == 2 * W * GEOMETRY.layer_token_bytes   # the 2 SWA layers' W tokens
    full = connector_spec(IDENTITY, KvGeometry(3, 2, 8, 2, "cpu", "bfloat16"))
    assert not full.has_swa and full.fingerprint() != SPEC.fingerprint()


def test_a_cold_prefill_saves_its_blocks_and_the_window_at_p_in_the_step_that_reaches_p(ledgers):
    side = SchedulerSide(ledgers[0], SPEC, state=ledgers[1], groups=GROUPS)
    req = request("c", 700)                               # p = 640: window [384, 640) = blocks 3, 4
    assert side.matched_tokens(req, 0) == 0
    side.after_alloc(req, 0)
    plan = side.plan_step(_new(req, 0, 300))
    assert plan.window_saves == () and [(s.start, s.end) for s in plan.saves] == [(0, 2)]
    plan = side.plan_step(step(cached=[("c", None, 300)], scheduled={"c": 300}))
    assert plan.window_saves == ()
    plan = side.plan_step(step(cached=[("c", None, 600)], scheduled={"c": 100}))
    (window,) = plan.window_saves
    assert (window.position, window.block_ids, window.skip) == (640, ((3, 4), (23, 24)), 0)
    assert window.key == chain_keys(req.prompt_token_ids, SPEC)[4]
    assert plan.by_request and plan.loads == ()


def _new(req: SimpleNamespace, computed: int, n: int) -> SimpleNamespace:
    """A new request's step: group g holds blocks 10·g + i (group 1, the full one: 10 …)."""
    blocks = (ids(0), ids(10), ids(20))
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=blocks,
                                                               num_computed_tokens=computed)],
                           num_scheduled_tokens={req.request_id: n},
                           scheduled_cached_reqs=step().scheduled_cached_reqs)


def test_check_is_rule_3_prime_over_blocks_and_snapshots(ledgers):
    ledger, state = ledgers
    side = SchedulerSide(ledger, SPEC, state=state, groups=GROUPS)
    req = request("h", 700)
    keys = chain_keys(req.prompt_token_ids, SPEC)
    ledger.put_chain(keys[:5], [bytes(SPEC.block_bytes())] * 5)
    assert side.matched_tokens(req, 0) == 0               # blocks alone: no exact resume
    state.put(keys[1], 2 * B, bytes(SPEC.state_size_to_disk()))
    assert side.matched_tokens(req, 0) == 2 * B           # the latest earlier snapshot
    state.put(keys[4], 5 * B, bytes(SPEC.state_size_to_disk()))
    assert side.matched_tokens(req, 0) == 5 * B           # the snapshot at L1 = ⌊699/128⌋·128
    assert side.matched_tokens(req, 2 * B) == 3 * B


def test_saved_window_and_blocks_load_back_asynchronously_and_a_bad_snapshot_fails_the_request(ledgers):
    ledger, state = ledgers
    src = caches(1)
    req = request("r", 700)
    cold = SchedulerSide(ledger, SPEC, state=state, groups=GROUPS)
    cold.after_alloc(req, 0)
    assert forward(worker(ledgers, src), cold.plan_step(_new(req, 0, 700))) == (set(), set())

    side = SchedulerSide(ledger, SPEC, state=state, groups=GROUPS)
    again = request("s", 700)                             # the same tokens, a new request
    ext = side.matched_tokens(again, 0)
    assert ext == 5 * B
    side.after_alloc(again, ext, (ids(40), ids(50), ids(60)))
    plan = side.plan_step(step())                         # the load goes out before the request runs
    assert plan.by_request and [(r.start, r.block_ids) for r in plan.loads] == [(0, (50, 51, 52, 53, 54))]
    (window,) = plan.window_loads
    assert (window.position, window.block_ids) == (5 * B, ((43, 44), (63, 64)))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    assert forward(worker(ledgers, dst), plan) == ({"s"}, set())
    assert torch.equal(dst[NAMES[1]][50:55], src[NAMES[1]][10:15])
    assert torch.equal(dst[NAMES[0]][43:45], src[NAMES[0]][3:5]) and torch.equal(dst[NAMES[2]][63:65],
                                                                                  src[NAMES[2]][23:25])
    assert not dst[NAMES[0]][40:43].any()                 # outside the window: not written
    plan = side.plan_step(_new(again, 5 * B, 700 - 5 * B))   # it runs from 640: nothing loaded or saved again
    assert plan.loads == plan.window_loads == plan.window_saves == () and plan.saves == ()
    assert side.finished("s")["kvledger"] == {"namespace": "default", "loaded_tokens": 5 * B, "failed_blocks": 0,
                                              "window_at": 5 * B}

    path = SnapshotFiles(ledger.store.root).path(chain_keys(req.prompt_token_ids, SPEC)[4])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    bad = request("t", 700)
    ext = side.matched_tokens(bad, 0)                     # the file is there: metadata says hit
    side.after_alloc(bad, ext, (ids(40), ids(50), ids(60)))
    done, failed = forward(worker(ledgers, {k: torch.zeros_like(v) for k, v in src.items()}), side.plan_step(step()))
    assert done == failed == {"t"}
    side.note_failed_requests(failed)
    assert side.finished("t")["kvledger"] == {"namespace": "default", "loaded_tokens": 0, "failed_blocks": 5,
                                              "window_at": 0}
    assert side.matched_tokens(request("u", 700), 0) == 0   # the damaged file was removed: a miss now
