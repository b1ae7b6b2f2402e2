import json
import math
import time
from dataclasses import replace

import pytest

from kvledger.bench.sim_core import SimConfig, simulate
from kvledger.bench.trace import DEFAULT_TRACE, TraceRequest, read_trace
from kvledger.bench.workloads import generate
from kvledger.core import ModelSpec, decide_hit, prefill_store_positions

V4 = ModelSpec.preset("deepseek-v4.1-flash")
SMOL = ModelSpec.preset("smollm2-135m")


def test_ideal_equals_reuse_ceiling_on_the_whole_trace(run_cli):
    seen: set[int] = set()
    refs = repeats = 0
    for line in DEFAULT_TRACE.read_text().splitlines():
        for h in json.loads(line)["hash_ids"]:
            refs, repeats = refs + 1, repeats + (h in seen)
            seen.add(h)
    t0 = time.monotonic()
    p = run_cli("bench", "sim", "--trace", str(DEFAULT_TRACE), "--ideal", "--json")
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["requests"] == len(DEFAULT_TRACE.read_text().splitlines())
    assert out["reuse_ceiling"] == pytest.approx(repeats / refs, abs=1e-12)
    assert out["block_hit_rate"] == pytest.approx(repeats / refs, abs=1e-12)
    assert 0 < out["ttft_p50_s"] <= out["ttft_p99_s"]
    assert elapsed < 30


# --- the rules: the simulator decides hits the way kvledger.core does -----------------------

def _pair(gap_s: float = 100.0) -> list[TraceRequest]:
    """A writes 4 ids of 512 tokens (2048 tokens); B extends A's prompt to 4096 tokens."""
    return [TraceRequest(0.0, 2048, 0, (1, 2, 3, 4)), TraceRequest(gap_s, 4096, 0, (1, 2, 3, 4, 5, 6, 7, 8))]


@pytest.mark.parametrize("swa, replay, snapshots", [
    ("memory", False, set(prefill_store_positions(2048, V4))),  # A's snapshots sit at 1792 and 1920, not at L1 = 2048
    ("memory", True, set()),
    ("zero", True, set()),
    ("full", False, {2048}),
    ("periodic", False, set()),                              # periodic:4 stores 512, 1024, 1536 (≤ 1920)
])
def test_hit_matches_decide_hit(swa, replay, snapshots):
    res = simulate(_pair(), SimConfig(spec=V4, swa=swa, replay=replay))
    expect = decide_hit(4096, 16, snapshots, V4, replay=replay or swa == "zero")
    assert res.hit_tokens == expect.hit_tokens
    assert res.computed_tokens == 2048 + 4096 - expect.recompute_from
    assert res.kinds[expect.kind.value] == 1


def test_snapshot_at_l1_is_used_when_stored_there():
    # A's prompt of 2049 tokens stores its snapshot at ⌊2048/128⌋·128 = 2048 = L1 of B.
    reqs = [TraceRequest(0.0, 2049, 0, (1, 2, 3, 4, 9)), TraceRequest(100.0, 4096, 0, (1, 2, 3, 4, 5, 6, 7, 8))]
    res = simulate(reqs, SimConfig(spec=V4))
    assert res.kinds["snapshot"] == 1 and res.hit_tokens == 2048
    assert simulate(reqs, SimConfig(spec=V4, state_slots=0)).kinds["fallback"] == 1


TINY = ModelSpec.preset("tiny-v4")   # windowed, not trained for the fallback: rule 3′ (exact resume)


def test_a_model_that_resumes_exactly_hits_at_the_latest_snapshot():
    """Rule 3′ (tiny-v4, Gemma 3): without a snapshot at L1 the hit is the latest snapshot q < L1 whose blocks
    are all present, as `decide_hit` decides it with every candidate position (it was 0 before: the simulator
    asked `decide_hit` with no snapshot, which for such a model is a miss)."""
    reqs = _pair()   # A (2048 tokens) stores its snapshots at c = 1792 and p = 1920; B's L1 = 2048
    stored = set(prefill_store_positions(2048, TINY))
    expect = decide_hit(4096, 16, stored, TINY)
    res = simulate(reqs, SimConfig(spec=TINY))
    assert expect.kind.value == "snapshot" and expect.hit_tokens == 1920
    assert res.hit_tokens == expect.hit_tokens and res.kinds["snapshot"] == 1
    assert res.computed_tokens == 2048 + 4096 - 1920
    assert simulate(reqs, SimConfig(spec=TINY, state_slots=0)).hit_tokens == 0   # no snapshot anywhere: a miss
    assert simulate(reqs, SimConfig(spec=TINY, swa="full")).hit_tokens == decide_hit(4096, 16, {2048}, TINY).hit_tokens
    assert simulate(reqs, SimConfig(spec=TINY, replay=True)).kinds["replay"] == 1


GEMMA = ModelSpec.preset("gemma3-270m")   # W = 512, R = 1: a snapshot at L1 restores every window


def _three_on_one_prefix(tail_tokens: int = 137) -> list[TraceRequest]:
    """Three prompts of 8 shared blocks (1,024 tokens, ids 1–8) and a tail of their own, none ending at 1,024."""
    n = 1024 + tail_tokens
    tails = ((21, 22), (31, 32), (41, 42))
    return [TraceRequest(100.0 * k, n, 0, (*range(1, 9), *tail)[: -(-n // 128)], 128)
            for k, tail in enumerate(tails)]


def test_rule_4pp_a_branch_point_serves_the_third_prompt():
    """Rule 4″ (a): the second prompt finds the blocks to 1,024 but no window there (the first snapshotted at its
    own end, 1,152), so it misses and, under `shared`, snapshots at 1,024; the third hits there. Rule 4 alone: every
    one after the first misses."""
    reqs = _three_on_one_prefix()
    assert simulate(reqs, SimConfig(spec=GEMMA)).hit_tokens == 0
    shared = simulate(reqs, SimConfig(spec=GEMMA, swa="shared"))
    assert (shared.hit_tokens, shared.kinds["snapshot"], shared.kinds["miss"]) == (1024, 1, 2)
    assert shared.computed_tokens == 3 * 1161 - 1024
    assert simulate(reqs, SimConfig(spec=SMOL, swa="shared")).hit_tokens == 2 * 1024   # full attention: no window


def test_rule_4pp_b_a_message_end_serves_the_second_prompt():
    """Rule 4″ (b): a request's segments stand for its messages; the first's system message ends at 1,061, so its
    prefill also snapshots at 1,024, and the second conversation hits there."""
    from kvledger.bench.trace import TraceSegment

    system = TraceSegment(1, 1061)
    reqs = [TraceRequest(100.0 * k, 1061 + 100, 0, (*range(1, 9), 10 * k + 9, 10 * k + 10)[:10], 128,
                         session=k, segments=(system, TraceSegment(10 + k, 100))) for k in range(2)]
    memory = simulate(reqs, SimConfig(spec=GEMMA))
    assert memory.hit_tokens == 0 and (memory.first_turns, memory.first_turn_hits) == (2, 0)
    shared = simulate(reqs, SimConfig(spec=GEMMA, swa="shared"))
    assert (shared.hit_tokens, shared.kinds["snapshot"]) == (1024, 1)
    assert (shared.first_turns, shared.first_turn_hits, shared.first_turn_hit_share) == (2, 1, 0.5)


def test_rule_4pp_snapshots_go_first_from_a_full_pool():
    """Extras enter the pool as its least recently used: with two slots on one engine, the second prompt's branch
    point (1,024, stored first, as the engine stores checkpoints before the prompt's end) is pushed out by its own
    rule-4 snapshot (1,152) ahead of the first prompt's older one, so the third misses; with three it is kept."""
    reqs = _three_on_one_prefix()
    two = SimConfig(spec=GEMMA, swa="shared", prefill_engines=1, decode_engines=1, state_slots=2)
    assert simulate(reqs, two).hit_tokens == 0
    assert simulate(reqs, replace(two, state_slots=3)).hit_tokens == 1024


def test_the_state_pool_puts_an_extra_last_in_line():
    from kvledger.bench.sim_store import StatePool

    pool = StatePool(2)
    pool.put("a")
    pool.put("b", extra=True)   # the least recently used now: a newer snapshot evicts it first
    pool.put("c")
    assert "b" not in pool and "a" in pool and "c" in pool
    single = StatePool(1)
    single.put("a")
    single.put("x", extra=True)   # room is made before it enters: an extra is never its own victim
    assert "x" in single and "a" not in single


def test_cap_and_full_attention_model():
    same = [TraceRequest(0.0, 2048, 0, (1, 2, 3, 4)), TraceRequest(100.0, 2048, 0, (1, 2, 3, 4))]
    cap = decide_hit(2048, 16, set(), V4).cap  # 1792: the last 134 tokens (and the block around them) are computed
    full = simulate(same, SimConfig(spec=V4, swa="full"))
    assert full.hit_tokens == decide_hit(2048, 16, {cap}, V4).hit_tokens == cap
    assert simulate(same, SimConfig(spec=SMOL)).hit_tokens == 2047  # full attention: L − 1, every block present
    assert simulate(same, SimConfig(spec=V4, ideal=True)).hit_tokens == 2048  # no cap


def test_in_flight_prompt_is_not_a_hit_but_ideal_ignores_it():
    reqs = _pair(gap_s=0.01)  # B arrives while A's 2048 tokens are still being computed
    assert simulate(reqs, SimConfig(spec=V4)).hit_tokens == 0
    assert simulate(reqs, SimConfig(spec=V4, ideal=True)).block_hits == 4


def test_ttl_expires_and_is_renewed_by_a_hit():
    reqs = _pair(gap_s=100.0)
    assert simulate(reqs, SimConfig(spec=V4, swa="full", ttl_s={"agent": 50, "chatbot": 50})).hit_tokens == 0
    assert simulate(reqs, SimConfig(spec=V4, swa="full", ttl_s={"agent": 50, "chatbot": 150})).hit_tokens > 0
    # a hit at t=40 renews A's blocks: a third request at t=80 still hits with a 50 s TTL
    three = [TraceRequest(0.0, 2048, 0, (1, 2, 3, 4)), TraceRequest(40.0, 2048, 0, (1, 2, 3, 4)),
             TraceRequest(80.0, 2048, 0, (1, 2, 3, 4))]
    res = simulate(three, SimConfig(spec=V4, swa="full", ttl_s={"agent": 50, "chatbot": 50}))
    assert res.kinds["snapshot"] == 2


def test_capacity_evicts_least_recently_used_tails_first():
    block = V4.block_bytes() * 4  # one 512-token id
    reqs = _pair()
    # room for 3 of A's 4 ids: its tail id goes, B reuses the 3 leading ids
    res = simulate(reqs, SimConfig(spec=V4, swa="zero", capacity_bytes=3 * block))
    assert res.hit_tokens == decide_hit(4096, 12, set(), V4, replay=True).hit_tokens == 1536
    assert simulate(reqs, SimConfig(spec=V4, swa="zero", capacity_bytes=3 * block - 1)).hit_tokens == 1024


def test_local_caches_do_not_share():
    reqs = _pair()
    shared = simulate(reqs, SimConfig(spec=V4, swa="full", routing="match"))
    assert simulate(reqs, SimConfig(spec=V4, swa="full", routing="affinity")).hit_tokens == shared.hit_tokens > 0
    randoms = {simulate(reqs, SimConfig(spec=V4, swa="full", routing="random", seed=s)).hit_tokens for s in range(12)}
    assert randoms == {0, shared.hit_tokens}  # a hit only when both land on the same engine


def test_decode_writes_make_the_next_turn_hit():
    reqs = generate("chat", seed=1, sessions=30).requests
    res = simulate(reqs, SimConfig(spec=V4))
    assert res.decode_blocks_written > 0 and res.kinds["snapshot"] > 0


# --- sanity over a real trace: monotone in capacity and TTL --------------------------------

@pytest.fixture(scope="module")
def head():
    return read_trace(DEFAULT_TRACE).requests[:1500]


@pytest.mark.parametrize("routing, swa", [("match", "memory"), ("match", "full"), ("match", "periodic"),
                                          ("random", "memory")])
def test_more_capacity_never_lowers_the_hit_rate(head, routing, swa):
    rates = [simulate(head, SimConfig(spec=V4, routing=routing, swa=swa, capacity_bytes=gb * 1e9)).block_hit_rate
             for gb in (0.5, 1, 2, 4, 8, 16, math.inf)]
    assert rates == sorted(rates) and rates[0] < rates[-1]


def test_longer_ttl_never_lowers_the_hit_rate(head):
    span = head[-1].arrival_s
    cfg = SimConfig(spec=V4)
    rates = [simulate(head, replace(cfg, ttl_s=dict.fromkeys(("agent", "chatbot"), d / 7 * span))).block_hit_rate
             for d in (0.25, 1, 3, 7)]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert rates[-1] <= simulate(head, cfg).block_hit_rate


def test_engine_policies_of_the_live_router_over_the_shared_store():
    """`match` with the live router's policies: the hit rate is the shared store's whichever engine computes;
    the policy moves only where the work queues (round-robin alternates, prefix-affinity keeps a prefix on one
    engine, least-loaded avoids the busy one)."""
    from kvledger.bench.sim_core import ENGINE_POLICIES, Simulator

    reqs = [TraceRequest(float(i), 1024, 1, (1, 2, 3, 4 + i % 3, 100 + i), 128) for i in range(30)]  # 1 s apart
    one_engine = simulate(reqs, SimConfig(spec=SMOL, prefill_engines=1)).hit_tokens
    engines_of = {}
    for policy in ENGINE_POLICIES:
        sim = Simulator(reqs, SimConfig(spec=SMOL, prefill_engines=3, engine_policy=policy))
        assert sim.run().hit_tokens == one_engine > 0, policy
        engines_of[policy] = sim.served
    assert engines_of["round-robin"] == [10, 10, 10]
    assert sorted(engines_of["prefix-affinity"]) == [0, 0, 30]    # one first block: one engine
    assert engines_of["least-loaded"] == engines_of["cache-aware"] == [30, 0, 0]   # idle engines, ties → lowest
    with pytest.raises(AssertionError):
        SimConfig(spec=SMOL, routing="random", engine_policy="round-robin")


def test_capacity_evicts_down_to_the_low_watermark():
    from kvledger.bench.sim_store import SimBlockStore

    store = SimBlockStore(1000, low_watermark=0.5)
    for k in range(10):
        store.put(k, 1, 100, 0.0, math.inf)
    assert store.bytes == 1000 and len(store) == 10          # at the capacity: nothing evicted
    store.put(10, 1, 100, 0.0, math.inf)
    assert store.bytes == 500 and store.units(0, 0.0) == 0 and store.units(10, 0.0) == 1


def test_the_device_pool_serves_what_the_store_lost_and_holds_only_its_size():
    """engine/loader.py raises a hit to what the engine's device prefix cache holds: an expired or evicted store
    block still hits while the device keeps it (no TTL there), until admissions of other requests need its room."""
    again = [TraceRequest(0.0, 1000, 1, tuple(range(1, 8)), 128), TraceRequest(100.0, 1000, 1, tuple(range(1, 8)), 128)]
    expired = SimConfig(spec=SMOL, ttl_s={"agent": 10.0, "chatbot": 10.0})
    assert simulate(again, expired).hit_tokens == 0
    on_device = simulate(again, replace(expired, device_blocks=64))
    assert on_device.hit_tokens == 896 and on_device.fetch_bytes == 0   # 7 blocks from the device, none fetched
    others = [TraceRequest(1.0 + k, 1000, 1, tuple(range(100 * k, 100 * k + 8)), 128) for k in range(1, 6)]
    crowded = sorted(again + others, key=lambda r: r.arrival_s)
    assert simulate(crowded, replace(expired, device_blocks=24)).hit_tokens == 0   # 5 × 8 blocks pushed it out
    assert simulate(crowded, replace(expired, device_blocks=64)).hit_tokens == 896


def test_segments_are_evicted_and_refreshed_whole():
    """The live store's unit (LmdbStore): the blocks one write added go together, and a hit on one renews all."""
    from kvledger.bench.sim_store import SimBlockStore

    store = SimBlockStore(500)
    for k in (1, 2, 3):
        store.put(k, 1, 100, 0.0, 10.0, group="first write")
    store.put(4, 1, 100, 1.0, 10.0, group="second write")
    store.touch(3, 5.0, 10.0)                        # a hit on one block renews its segment, whole
    assert [store.units(k, 12.0) for k in (1, 2, 3, 4)] == [1, 1, 1, 0]
    for k in (5, 6, 7):
        store.put(k, 1, 100, 12.0, 10.0)             # the third: 600 > 500, the least recently used segment goes whole
    assert [store.units(k, 12.0) for k in (1, 2, 3, 5, 6, 7)] == [0, 0, 0, 1, 1, 1] and store.bytes == 300
