"""Slices of a block under tensor and pipeline parallelism (`slices.py`), on plain arrays and a real store.

A block here is `n_layers` × `kv_heads` × `head_bytes` bytes, every byte naming its (layer, head), so a part
copied to the wrong place shows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvledger.core import chain_keys
from kvledger.integrations.vllm.config import KvGeometry, connector_spec
from kvledger.integrations.vllm.identity import ModelIdentity
from kvledger.integrations.vllm.scheduler import SchedulerSide
from kvledger.integrations.vllm.slices import (
    KvSlice,
    Slicing,
    engine_slices,
    first_replica,
    head_range,
    is_partition,
)
from kvledger.store.ledger import BlockLedger

HEAD_BYTES = 16   # a toy head: one layer's share of one block for one KV head


def block(n_layers: int, kv_heads: int) -> np.ndarray:
    """A whole block: byte (layer, head, i) = 16·layer + head (+ 100 for odd i), layer-major as vLLM's layout."""
    b = np.zeros((n_layers, kv_heads, HEAD_BYTES), dtype=np.uint8)
    for layer in range(n_layers):
        for head in range(kv_heads):
            b[layer, head] = 16 * layer + head
            b[layer, head, 1::2] += 100
    return b


def part_of(whole: np.ndarray, s: KvSlice) -> np.ndarray:
    """What a worker holding slice `s` has of the block: its layers, its heads, in its own layout."""
    return np.ascontiguousarray(whole[s.layer0:s.layer1, s.head0:s.head1]).reshape(-1)


def worker(kv_heads: int, n_layers: int, tp: int, rank: int, stages=None, stage: int = 0) -> Slicing:
    stages = stages or ((0, n_layers),)
    engine = engine_slices(kv_heads, tp, stages)
    own = KvSlice(*head_range(kv_heads, rank, tp), *stages[stage])
    return Slicing(kv_heads, n_layers, HEAD_BYTES, engine, own, first_replica(kv_heads, rank, tp))


def test_heads_split_as_vllm_splits_them_and_replicas_store_once():
    assert [head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [head_range(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]          # Gemma 3 270M under TP = 2
    assert [head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [first_replica(2, r, 4) for r in range(4)] == [True, False, True, False]
    assert all(first_replica(4, r, 2) for r in range(2))
    assert engine_slices(1, 2, ((0, 18),)) == (KvSlice(0, 1, 0, 18),)          # one slice: the whole block
    assert engine_slices(4, 2, ((0, 2), (2, 4))) == (KvSlice(0, 2, 0, 2), KvSlice(2, 4, 0, 2),
                                                     KvSlice(0, 2, 2, 4), KvSlice(2, 4, 2, 4))
    assert is_partition(engine_slices(4, 2, ((0, 2), (2, 4))), 4, 4)
    assert not is_partition((KvSlice(0, 2, 0, 4),), 4, 4)


def test_a_key_names_the_slice_and_the_whole_block_keeps_its_chain_key():
    s = worker(4, 3, 2, 0)
    key = bytes(range(16))
    parts = [s.key(key, p) for p in s.engine]
    assert s.key(key, s.everything) == key                 # TP = 1: the keys of an engine without parallelism
    assert len(set(parts)) == 2 and key not in parts and all(len(k) == 16 for k in parts)
    assert s.key(bytes(16), s.engine[0]) != parts[0]       # and the block's chain key


def test_partitions_are_the_engines_own_first_then_every_even_head_split():
    s = worker(4, 3, 2, 1)
    whole, halves, quarters = ((KvSlice(0, 4, 0, 3),), (KvSlice(0, 2, 0, 3), KvSlice(2, 4, 0, 3)),
                               tuple(KvSlice(h, h + 1, 0, 3) for h in range(4)))
    assert s.partitions() == (halves, whole, quarters)
    assert Slicing.whole(4, 3, HEAD_BYTES).partitions() == (whole, halves, quarters)
    assert s.reads(whole) == whole and s.reads(halves) == (halves[1],) and s.reads(quarters) == quarters[2:]


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2)])
def test_a_worker_assembles_its_heads_from_another_degrees_parts(writer_tp, reader_tp):
    kv_heads, n_layers = 4, 3
    whole = block(n_layers, kv_heads)
    written = {s: part_of(whole, s) for s in engine_slices(kv_heads, writer_tp, ((0, n_layers),))}
    for rank in range(reader_tp):
        reader = worker(kv_heads, n_layers, reader_tp, rank)
        row = np.zeros(reader.part_bytes(reader.own), dtype=np.uint8)
        for s in reader.reads(tuple(written)):
            reader.copy_part(written[s], s, row)
        assert np.array_equal(row, part_of(whole, reader.own))


def test_a_pipeline_stage_takes_its_layers_of_a_whole_block():
    """Pipeline parallelism 2 (and TP 2): each worker's part is its heads of its stage's layers, and a part of
    a whole block stored by an engine without parallelism is copied out of it by layer and head."""
    kv_heads, n_layers, stages = 4, 4, ((0, 2), (2, 4))
    whole = block(n_layers, kv_heads)
    everything = KvSlice(0, kv_heads, 0, n_layers)
    for stage in range(2):
        for rank in range(2):
            reader = worker(kv_heads, n_layers, 2, rank, stages, stage)
            assert reader.own == KvSlice(2 * rank, 2 * rank + 2, *stages[stage])
            row = np.zeros(reader.part_bytes(reader.own), dtype=np.uint8)
            reader.copy_part(whole.reshape(-1), everything, row)
            assert np.array_equal(row, part_of(whole, reader.own))
            assert row.nbytes == 2 * 2 * HEAD_BYTES


def test_a_block_is_present_only_when_every_part_of_one_partition_is(tmp_path):
    """The CHECK of a TP = 1 engine over blocks stored as TP = 2 parts: block 0 has both halves, block 1 only
    one (absent: the reader needs every head), block 2 the whole block; the hit stops at block 1."""
    geometry = KvGeometry(3, 4, 8, 2, "cpu", "bfloat16")
    spec = connector_spec(ModelIdentity("ab" * 32, "bfloat16"), geometry)
    tokens = list(range(4 * 128))
    keys = chain_keys(tokens, spec)
    halves = engine_slices(4, 2, ((0, 3),))
    scheduler_slicing = Slicing(4, 3, 128 * 2 * 8 * 2, (KvSlice(0, 4, 0, 3),))
    with BlockLedger.open(tmp_path / "store") as ledger:
        def put(key: bytes, s: KvSlice) -> None:
            ledger.put_chain([scheduler_slicing.key(key, s)], [np.zeros(scheduler_slicing.part_bytes(s), np.uint8)])
        for s in halves:
            put(keys[0], s)
        put(keys[1], halves[0])
        put(keys[2], KvSlice(0, 4, 0, 3))
        side = SchedulerSide(ledger, spec, slicing=scheduler_slicing)
        req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, cache_salt=None, all_token_ids=tokens)
        assert side.matched_tokens(req, 0) == 128 and side.sources["r"] == (1,)   # the halves: partition 1
        put(keys[1], halves[1])
        assert side.matched_tokens(req, 0) == 3 * 128 and side.sources["r"] == (1, 1, 0)
        tp2 = SchedulerSide(ledger, spec, slicing=Slicing(4, 3, scheduler_slicing.head_bytes, halves))
        assert tp2.matched_tokens(req, 0) == 3 * 128 and tp2.sources["r"] == (0, 0, 1)   # own, own, whole


def test_workers_of_one_degree_load_what_workers_of_another_saved(tmp_path):
    """The worker side on vLLM's CPU layout ([blocks, heads, 128, 2·head_dim] per layer, plain tensors): two
    TP = 2 workers save their halves of blocks 3 and 5, a TP = 1 worker loads them (the partition its
    scheduler found) into blocks 7 and 8; a TP = 1 worker saves whole blocks, and each TP = 2 worker loads its
    heads of them. Every byte lands where the whole cache had it; nothing else is written."""
    import torch

    from kvledger.integrations.vllm.layout import KvLayout
    from kvledger.integrations.vllm.records import BlockRun, StepPlan
    from kvledger.integrations.vllm.worker import WorkerSide

    heads, head_dim, n_layers, num_blocks, b = 4, 8, 3, 10, 128
    geometry = KvGeometry(n_layers, heads, head_dim, 2, "cpu", "bfloat16")
    spec = connector_spec(ModelIdentity("ab" * 32, "bfloat16"), geometry)
    head_bytes = b * 2 * head_dim * 2
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    g = torch.Generator().manual_seed(0)
    whole = {n: torch.randn((num_blocks, heads, b, 2 * head_dim), generator=g).to(torch.bfloat16) for n in names}
    tp1 = Slicing.whole(heads, n_layers, head_bytes)
    tp2 = [Slicing(heads, n_layers, head_bytes, engine_slices(heads, 2, ((0, n_layers),)), s)
           for s in engine_slices(heads, 2, ((0, n_layers),))]

    def side(ledger: BlockLedger, slicing: Slicing, caches: dict) -> WorkerSide:
        w = WorkerSide(ledger, slicing=slicing)
        assert slicing.own is not None
        w.register(KvLayout(caches, num_blocks, slicing.own.heads * head_bytes))
        return w

    def forward(w: WorkerSide, plan: StepPlan) -> None:
        w.start_step(plan)
        for name in names:
            w.layer_loaded(name)
            w.layer_computed(name)
        w.finish_step()
        assert w.take_failed() == set()

    def run(req_id: str, tokens: list[int], ids: tuple[int, ...], sources: tuple[int, ...] = ()) -> BlockRun:
        keys = chain_keys(tokens, spec)[:len(ids)]
        return BlockRun(req_id, "default", 0, tuple(keys), ids, None, sources)

    x, y = list(range(300)), list(range(1000, 1300))
    with BlockLedger.open(tmp_path / "store", fsync=False) as ledger:
        for s in tp2:   # each TP = 2 worker's cache holds its heads only
            h = s.own
            forward(side(ledger, s, {n: whole[n][:, h.head0:h.head1].contiguous() for n in names}),
                    StepPlan(saves=(run("x", x, (3, 5)),)))
        forward(side(ledger, tp1, whole), StepPlan(saves=(run("y", y, (3, 5)),)))

        def sources(slicing: Slicing, tokens: list[int]) -> tuple[int, ...]:
            check = SchedulerSide(ledger, spec, slicing=Slicing(heads, n_layers, head_bytes, slicing.engine))
            req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, cache_salt=None, all_token_ids=tokens)
            assert check.matched_tokens(req, 0) == 256
            return check.sources["r"]

        assert sources(tp1, x) == (1, 1) and sources(tp2[0], y) == (1, 1)   # halves for TP = 1; whole for TP = 2
        dst = {n: torch.zeros_like(whole[n]) for n in names}
        forward(side(ledger, tp1, dst), StepPlan(loads=(run("x", x, (7, 8), (1, 1)),)))
        for n in names:
            assert torch.equal(dst[n][7:9], whole[n][[3, 5]]) and not dst[n][:7].any() and not dst[n][9:].any()
        for s in tp2:
            h = s.own
            dst = {n: torch.zeros_like(whole[n][:, h.head0:h.head1]) for n in names}
            forward(side(ledger, s, dst), StepPlan(loads=(run("y", y, (7, 8), (1, 1)),)))
            for n in names:
                assert torch.equal(dst[n][7:9], whole[n][[3, 5], h.head0:h.head1]) and not dst[n][:7].any()


def test_a_replicated_head_is_stored_once_under_the_blocks_chain_keys(tmp_path):
    """One KV head under TP = 2 (Gemma 3 270M's): both workers hold the whole block; the first stores it, under
    the chain keys an engine without parallelism uses; the second stores nothing."""
    import torch

    from kvledger.integrations.vllm.layout import KvLayout
    from kvledger.integrations.vllm.records import BlockRun, StepPlan
    from kvledger.integrations.vllm.events import EventLog
    from kvledger.integrations.vllm.worker import WorkerSide

    geometry = KvGeometry(2, 1, 8, 2, "cpu", "bfloat16")
    spec = connector_spec(ModelIdentity("ab" * 32, "bfloat16"), geometry)
    head_bytes, names, tokens = 128 * 2 * 8 * 2, ["model.layers.0.attn", "model.layers.1.attn"], list(range(256))
    keys = tuple(chain_keys(tokens, spec))
    engine = engine_slices(1, 2, ((0, 2),))
    with BlockLedger.open(tmp_path / "store", fsync=False) as ledger:
        for rank in range(2):
            slicing = Slicing(1, 2, head_bytes, engine, KvSlice(*head_range(1, rank, 2), 0, 2),
                              first_replica(1, rank, 2))
            w = WorkerSide(ledger, EventLog(tmp_path / f"events{rank}.jsonl", bytes(32)), slicing=slicing)
            w.register(KvLayout({n: torch.ones((4, 1, 128, 16), dtype=torch.bfloat16) for n in names}, 4, head_bytes))
            w.start_step(StepPlan(saves=(BlockRun("r", "default", 0, keys, (1, 2), None),)))
            w.finish_step()
        assert ledger.exists(list(keys)) == [True, True] and ledger.stats().blocks == 2
        assert (tmp_path / "events0.jsonl").exists() and not (tmp_path / "events1.jsonl").exists()


def test_a_hit_from_parts_refreshes_the_parts_it_reads(tmp_path):
    """TTL (rule: a hit pushes expiry out) for a sliced engine: the load's refresh reaches the parts it reads,
    not the chain keys a sliced engine never stores. Class `c` = 1 day; the hit comes at 0.9 days; at 1.5 days
    the hit prompt's parts live on and an untouched prompt's have expired."""
    from kvledger.store.ttl import DAY_S, TtlPolicy
    from tests.integrations.test_vllm_sides import new_req, step

    class Clock:
        t = 1_000_000.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    geometry = KvGeometry(3, 4, 8, 2, "cpu", "bfloat16")
    spec = connector_spec(ModelIdentity("ab" * 32, "bfloat16"), geometry)
    halves = engine_slices(4, 2, ((0, 3),))
    slicing = Slicing(4, 3, 128 * 2 * 8 * 2, halves)
    hit, idle = list(range(300)), list(range(1000, 1300))
    policy = TtlPolicy.parse("c=1", "", "c")
    with BlockLedger.open(tmp_path / "store", fsync=False, clock=clock, policy=policy) as ledger:
        parts = {}
        for name, tokens in (("hit", hit), ("idle", idle)):
            keys = chain_keys(tokens, spec)[:2]
            for s in halves:
                own = [slicing.key(k, s) for k in keys]
                ledger.put_chain(own, [np.zeros(slicing.part_bytes(s), np.uint8)] * 2)
                parts.setdefault(name, []).extend(own)
        clock.t += 0.9 * DAY_S
        side = SchedulerSide(ledger, spec, slicing=slicing)
        req = SimpleNamespace(request_id="r", prompt_token_ids=hit, cache_salt=None, all_token_ids=list(hit))
        assert side.matched_tokens(req, 0) == 256
        side.after_alloc(req, 256)
        plan = side.plan_step(step(new=[new_req(req, [4, 5, 6], 256)], scheduled={"r": 44}))
        assert [run.block_ids for run in plan.loads] == [(4, 5)]
        clock.t += 0.6 * DAY_S
        assert ledger.exists(parts["hit"]) == [True] * 4 and ledger.exists(parts["idle"]) == [False] * 4
