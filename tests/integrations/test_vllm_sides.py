"""The connector's two sides without vLLM: a real block ledger on disk, KV caches as torch tensors
in vLLM's CPU layout, and vLLM's scheduler records as plain namespaces (vLLM itself is exercised
by test_vllm_connector.py in `.venv-vllm`)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvledger.core import chain_keys
from kvledger.integrations.vllm.config import ConnectorConfig, KvGeometry, connector_spec, namespace_of
from kvledger.integrations.vllm.events import EventLog
from kvledger.integrations.vllm.identity import ModelIdentity
from kvledger.integrations.vllm.layout import KvLayout
from kvledger.integrations.vllm.records import BlockRun, StepPlan
from kvledger.integrations.vllm.scheduler import SchedulerSide
from kvledger.integrations.vllm.worker import WorkerSide
from kvledger.store.ledger import BlockLedger

B = 128
GEOMETRY = KvGeometry(n_layers=3, kv_heads=2, head_dim=8, dtype_bytes=2, device="cpu", dtype="bfloat16")
IDENTITY = ModelIdentity("ab" * 32, "bfloat16", salt="tiny")   # weights of no file: the sides never read them
SPEC = connector_spec(IDENTITY, GEOMETRY)
NUM_BLOCKS = 16
EVENTS_KEY = bytes(range(32))


def request(req_id: str, n: int, salt: str | None = None, seed: int = 0) -> SimpleNamespace:
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 50_000) for _ in range(n)]
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens), cache_salt=salt)


def new_req(req: SimpleNamespace, block_ids: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=computed)


def step(new: list | None = None, cached: list | None = None, scheduled: dict | None = None,
         resumed: set | None = None) -> SimpleNamespace:
    cached = cached or []
    return SimpleNamespace(
        scheduled_new_reqs=new or [], num_scheduled_tokens=scheduled or {},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=resumed or set(),
                                              new_block_ids=[c[1] for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]))


@pytest.fixture
def ledger(tmp_path: Path) -> BlockLedger:
    with BlockLedger.open(tmp_path / "store", fsync=False) as led:
        yield led


def store_prefix(ledger: BlockLedger, req: SimpleNamespace, n_blocks: int) -> list[bytes]:
    keys = chain_keys(req.prompt_token_ids, SPEC, namespace_of(req.cache_salt))[:n_blocks]
    blocks = [bytes([i]) * SPEC.block_bytes() for i in range(n_blocks)]
    ledger.put_chain(keys, blocks, namespace=namespace_of(req.cache_salt))
    return keys


def test_spec_names_platform_and_dtype_and_is_full_attention():
    assert SPEC.name == "vllm-cpu:tiny:bfloat16" and not SPEC.has_swa and SPEC.block_size == B
    assert SPEC.block_bytes() == B * 3 * 2 * 2 * 8 * 2
    other = connector_spec(IDENTITY, KvGeometry(3, 2, 8, 4, "cpu", "float32"))
    assert other.fingerprint() != SPEC.fingerprint()


def test_config_rejects_unknown_keys_and_needs_a_store():
    with pytest.raises(ValueError, match="unknown extra config"):
        ConnectorConfig.from_extra({"path": "/x", "pth": "/y"})
    with pytest.raises(ValueError, match="path"):
        ConnectorConfig(path=None, redis_url=None, model=None)
    assert ConnectorConfig.from_extra({"path": "/x", "fsync": "false"}).fsync is False


def test_the_scheduler_and_worker_sides_of_one_process_share_one_open_store(tmp_path):
    from kvledger.integrations.vllm.config import shared_ledger

    config = ConnectorConfig.from_extra({"path": str(tmp_path / "shared"), "fsync": False})
    scheduler, worker = shared_ledger(config), shared_ledger(ConnectorConfig.from_extra({**{
        "path": str(tmp_path / "shared")}, "fsync": False}))
    assert scheduler is worker
    req = request("s", 300)
    store_prefix(worker, req, 2)
    assert SchedulerSide(scheduler, SPEC).matched_tokens(req, 0) == 2 * B


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pin is Linux's (mlock)")
def test_the_shared_store_keeps_its_index_in_memory_unless_told_not_to(tmp_path):
    from kvledger.integrations.vllm.config import shared_ledger

    pinned = shared_ledger(ConnectorConfig.from_extra({"path": str(tmp_path / "pinned"), "fsync": False}))
    pin = pinned.store.pin
    assert pin is not None and pin.wait(30) and pin.mode in ("locked", "mapped") and pin.pinned_bytes > 0
    unpinned = shared_ledger(ConnectorConfig.from_extra({"path": str(tmp_path / "unpinned"), "fsync": False,
                                                         "pin_index": "false"}))
    assert unpinned.store.pin is None


def test_check_counts_leading_blocks_caps_and_subtracts_the_local_hit(ledger):
    side = SchedulerSide(ledger, SPEC)
    req = request("a", 500)
    assert side.matched_tokens(req, 0) == 0
    store_prefix(ledger, req, 3)
    assert side.matched_tokens(req, 0) == side.matched_tokens(req, 0) == 3 * B  # callable twice, same answer
    assert side.matched_tokens(req, B) == 2 * B
    assert side.matched_tokens(req, 3 * B) == 0
    assert side.tracks == {}  # the CHECK keeps no state
    exact = request("a", 3 * B)  # the same first 384 tokens, all present: every token but the last is a hit
    assert side.matched_tokens(exact, 0) == 3 * B - 1
    assert side.matched_tokens(exact, 2 * B) == B - 1
    assert side.matched_tokens(request("a", 500, salt="tenantB"), 0) == 0  # another namespace shares nothing


def test_requests_whose_kv_token_ids_do_not_name_are_neither_loaded_nor_saved(ledger):
    side = SchedulerSide(ledger, SPEC)
    for field, value in (("mm_features", ["image"]), ("lora_request", "adapter"), ("prompt_embeds", object())):
        req = request("m", 500)
        store_prefix(ledger, req, 3)
        setattr(req, field, value)
        assert side.matched_tokens(req, 0) == 0
        side.after_alloc(req, 0)
        assert side.plan_step(step(new=[new_req(req, [1, 2, 3, 4], 0)], scheduled={"m": 500})) == StepPlan()


def test_check_stops_at_the_first_missing_block(ledger):
    side = SchedulerSide(ledger, SPEC)
    req = request("a", 700)
    keys = store_prefix(ledger, req, 4)
    ledger.delete([keys[1]])
    assert side.matched_tokens(req, 0) == B


def test_load_then_chunked_prefill_saves_only_newly_completed_blocks(ledger):
    side = SchedulerSide(ledger, SPEC)
    req = request("r", 1000)
    store_prefix(ledger, req, 2)
    ext = side.matched_tokens(req, 0)
    assert ext == 2 * B
    side.after_alloc(req, ext)
    ids = list(range(10, 18))
    plan = side.plan_step(step(new=[new_req(req, ids, ext)], scheduled={"r": 300}))
    (load,) = plan.loads
    assert (load.start, load.block_ids, load.parent) == (0, (10, 11), None)
    (save,) = plan.saves  # computed 256 → 556: blocks 2 and 3 end inside this chunk
    assert (save.start, save.block_ids) == (2, (12, 13))
    assert save.parent == load.keys[-1] and save.keys == tuple(chain_keys(req.all_token_ids, SPEC)[2:4])
    plan = side.plan_step(step(cached=[("r", None, 556)], scheduled={"r": 444}))
    assert plan.loads == () and [(s.start, s.end) for s in plan.saves] == [(4, 7)]  # 556 → 1000
    req.all_token_ids += [7] * 24  # decode: block 7 ends at 1024
    plan = side.plan_step(step(cached=[("r", None, 1022)], scheduled={"r": 1}))
    assert plan.saves == ()
    plan = side.plan_step(step(cached=[("r", None, 1023)], scheduled={"r": 1}))
    assert [(s.start, s.block_ids) for s in plan.saves] == [(7, (17,))]
    assert side.finished("r") == {"kvledger": {"namespace": "default", "loaded_tokens": 2 * B, "failed_blocks": 0}}


def test_a_prompt_of_whole_blocks_loads_its_last_block_whole_and_computes_one_token(ledger):
    """L = 3B, all present: vLLM is told L − 1 tokens are loaded; the load is all three blocks, the one token
    computed lands in the last of them, and no block is saved back; a failure of that last block costs
    exactly the B − 1 tokens it held of the hit."""
    side = SchedulerSide(ledger, SPEC)
    req = request("x", 3 * B)
    store_prefix(ledger, req, 3)
    ext = side.matched_tokens(req, 0)
    side.after_alloc(req, ext)
    plan = side.plan_step(step(new=[new_req(req, [5, 6, 7], ext)], scheduled={"x": 1}))
    (load,) = plan.loads
    assert (load.start, load.block_ids) == (0, (5, 6, 7)) and plan.saves == ()
    side.note_failed({7})
    assert side.finished("x")["kvledger"] == {"namespace": "default", "loaded_tokens": 2 * B, "failed_blocks": 1}

    local = request("y", 3 * B)   # vLLM's own cache holds two blocks: the ledger supplies the last one
    store_prefix(ledger, local, 3)
    ext = side.matched_tokens(local, 2 * B)
    assert ext == B - 1
    side.after_alloc(local, ext)
    plan = side.plan_step(step(new=[new_req(local, [1, 2, 3], 2 * B + ext)], scheduled={"y": 1}))
    assert [(r.start, r.block_ids) for r in plan.loads] == [(2, (3,))] and plan.saves == ()
    assert side.finished("y")["kvledger"]["loaded_tokens"] == B - 1


def test_preempted_request_replaces_its_block_list(ledger):
    side = SchedulerSide(ledger, SPEC)
    req = request("p", 600)
    side.after_alloc(req, 0)
    side.plan_step(step(new=[new_req(req, [1, 2], 0)], scheduled={"p": 256}))
    side.after_alloc(req, 0)  # preempted, then scheduled again from 0 with new blocks
    plan = side.plan_step(step(cached=[("p", ([8, 9, 3, 4, 5],), 0)], scheduled={"p": 600}, resumed={"p"}))
    assert [s.block_ids for s in plan.saves] == [(8, 9, 3, 4)]


def test_reported_failures_count_against_the_load(ledger):
    side = SchedulerSide(ledger, SPEC)
    req = request("f", 900)
    store_prefix(ledger, req, 5)
    side.after_alloc(req, side.matched_tokens(req, 0))
    side.plan_step(step(new=[new_req(req, [20, 21, 22, 23, 24, 25, 26, 27], 5 * B)], scheduled={"f": 260}))
    side.note_failed({23, 24})
    assert side.finished("f")["kvledger"] == {"namespace": "default", "loaded_tokens": 3 * B, "failed_blocks": 2}


def cpu_caches(seed: int) -> dict[str, torch.Tensor]:
    """KV caches in vLLM's CPU layout: [num_blocks, kv_heads, block_size, 2 × head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, GEOMETRY.kv_heads, B, 2 * GEOMETRY.head_dim)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(torch.bfloat16)
            for i in (2, 0, 1)}


def worker(ledger: BlockLedger, caches: dict[str, torch.Tensor], events: Path | None = None) -> WorkerSide:
    side = WorkerSide(ledger, EventLog(events, EVENTS_KEY) if events else None)
    side.register(KvLayout(caches, NUM_BLOCKS, B * GEOMETRY.layer_token_bytes))
    return side


def run_of(req: SimpleNamespace, start: int, block_ids: tuple[int, ...]) -> BlockRun:
    keys = chain_keys(req.all_token_ids, SPEC)
    end = start + len(block_ids)
    return BlockRun(req.request_id, "default", start, tuple(keys[start:end]), block_ids,
                    keys[start - 1] if start else None)


def forward(side: WorkerSide, plan: StepPlan, names: list[str]) -> set[int]:
    """What vLLM does around one forward pass: load, then per layer wait / compute / save, then save."""
    side.start_step(plan)
    for name in names:
        side.layer_loaded(name)
        side.layer_computed(name)
    side.finish_step()
    return side.take_failed()


def test_saved_blocks_load_back_into_other_vllm_blocks_layer_by_layer(ledger, tmp_path):
    src = cpu_caches(1)
    names = sorted(src)
    req = request("w", 500)
    events = tmp_path / "events.jsonl"
    assert forward(worker(ledger, src, events), StepPlan(saves=(run_of(req, 0, (3, 5, 6)),)), names) == set()
    assert ledger.match(chain_keys(req.prompt_token_ids, SPEC)) == 3
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    assert forward(worker(ledger, dst, events), StepPlan(loads=(run_of(req, 0, (7, 8, 9)),)), names) == set()
    for name in names:
        assert torch.equal(dst[name][7:10], src[name][[3, 5, 6]])
        assert not dst[name][:7].any()  # nothing else written
    assert [line.count('"ok": 3') for line in events.read_text().splitlines()] == [1, 1]


def test_a_corrupt_block_is_reported_never_copied_and_poisons_later_saves(ledger):
    src = cpu_caches(2)
    names = sorted(src)
    req = request("c", 700)
    forward(worker(ledger, src), StepPlan(saves=(run_of(req, 0, (0, 1, 2, 3)),)), names)
    seg = max((p for p in Path(ledger.store.root).rglob("*") if p.is_file() and p.stat().st_size > 4096),
              key=lambda p: p.stat().st_size)
    data = bytearray(seg.read_bytes())
    data[-SPEC.block_bytes() - 100] ^= 0xFF  # inside the third block (the segment ends with the fourth)
    seg.write_bytes(bytes(data))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    plan = StepPlan(loads=(run_of(req, 0, (8, 9, 10)),), saves=(run_of(req, 3, (11,)),))
    assert forward(worker(ledger, dst), plan, names) == {10}
    for name in names:
        assert torch.equal(dst[name][8:10], src[name][0:2]) and not dst[name][10:12].any()
    keys = chain_keys(req.prompt_token_ids, SPEC)
    assert ledger.exists(keys[:4]) == [True, True, False, True]  # the corrupt block is dropped, not re-saved


def test_the_sides_import_no_vllm():
    assert "vllm" not in sys.modules


def test_a_published_prefix_is_saved_once_as_public_and_read_by_every_salt_never_its_continuation(ledger, tmp_path):
    """Rule 12 under the connector (a request's `cache_salt` is its tenant): with `public_prefix` set, tenant A's
    prefill saves the prefix's whole blocks as the public namespace's and the rest as its own; tenant B then hits
    the public blocks only, though its prompt is A's token for token; a tenant's salt never names the public chain."""
    import json

    from kvledger.core import PUBLIC_NAMESPACE
    from kvledger.util.public_prefix import load_public_prefixes

    a = request("a", 600, salt="tenantA", seed=3)
    (tmp_path / "public.json").write_text(json.dumps([a.prompt_token_ids[:2 * B + 10]]))
    public = load_public_prefixes(tmp_path / "public.json", None, None, B)
    side = SchedulerSide(ledger, SPEC, public=public)
    assert side.matched_tokens(a, 0) == 0
    side.after_alloc(a, 0)
    plan = side.plan_step(step(new=[new_req(a, list(range(5)), 0)], scheduled={"a": 600}))
    assert [(r.start, len(r.keys), r.namespace) for r in plan.saves] == [(0, 2, PUBLIC_NAMESPACE), (2, 2, "tenantA")]
    side.finished("a")
    for run in plan.saves:   # what the worker side would write
        ledger.put_chain(list(run.keys), [bytes(SPEC.block_bytes())] * len(run.keys), namespace=run.namespace,
                         start_pos=run.start, parent=run.parent)

    b = SimpleNamespace(**{**vars(a), "request_id": "b", "cache_salt": "tenantB"})
    assert side.matched_tokens(b, 0) == 2 * B                                          # the public blocks only
    assert side.matched_tokens(SimpleNamespace(**{**vars(a), "request_id": "a2"}), 0) == 4 * B   # A: its own too
    named = SimpleNamespace(**{**vars(b), "request_id": "c", "cache_salt": PUBLIC_NAMESPACE})
    assert side.matched_tokens(named, 0) == 2 * B   # naming the public namespace reads no more than any tenant
    assert SchedulerSide(ledger, SPEC).matched_tokens(b, 0) == 0   # unpublished: B's own chain, nothing stored
