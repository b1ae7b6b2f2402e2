"""tiny-v4 on the engine with both ledgers: snapshot hits are exact, replay and fallback are bounded,
a next turn hits the decode replica, an unreachable state holder lowers the hit (rule 8), never hangs."""

import time

import pytest
import torch

from kvledger.core import HitKind, ModelSpec
from tests.engine.models.tiny_v4_paths import run
from kvledger.state.directory import MemoryDirectory
from kvledger.state.ledger import StateLedger
from tests.engine.helpers import approximate, prompt, run_request

SPEC = ModelSpec.preset("tiny-v4")
PROMPT = [t % 32000 for t in prompt(700, seed=3)]
TOKEN = "engine-test"


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def directory():
    return MemoryDirectory()


@pytest.fixture(scope="module")
def holder(directory):
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=1 << 24) as states:
        yield states


@pytest.fixture(scope="module")
def tiny(ledger, holder):
    from kvledger.engine.engine import Engine

    engine = Engine("tiny-v4", block_ledger=ledger, state_ledger=holder, kv_cache_bytes=16 << 20, replay=False)
    engine.record_logits = True
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def cold(tiny, ledger, holder):
    out, usage, d = run_request(tiny, ledger, PROMPT, request_id="cold", max_tokens=32, state_ledger=holder)
    assert d.kind is HitKind.MISS and usage.cached_tokens == 0
    return out, tiny.first_logits["cold"]


def test_snapshot_hit_is_exact(cold, tiny, ledger, holder):
    tiny.clear_device_cache()
    out, usage, d = run_request(tiny, ledger, PROMPT, request_id="hit", max_tokens=32, state_ledger=holder)
    assert d.kind is HitKind.SNAPSHOT and usage.hit_kind == "snapshot" and usage.cached_tokens == 512
    assert _rel(tiny.first_logits["hit"], cold[1]) <= 1e-4 and out == cold[0]


@pytest.mark.parametrize("replay", [False, True])
def test_fallback_and_replay_error_is_bounded(cold, tiny, ledger, replay):
    """Both asked for (the CHECK decides as V4 does, or with replay): approximations, never the default."""
    tiny.clear_device_cache()
    rid = f"no-snapshot-{replay}"
    _, usage, d = run_request(tiny, ledger, PROMPT, request_id=rid, max_tokens=1, state_ledger=None, replay=replay,
                              spec=approximate(SPEC))
    assert d.kind is (HitKind.REPLAY if replay else HitKind.FALLBACK)
    assert usage.cached_tokens == (512 if replay else 384)
    err = _rel(tiny.first_logits[rid], cold[1])
    assert 0 < err < 0.2, err  # the truncated window's error (measured ~0.04 on this prompt)


def test_a_decode_leg_continues_its_request_with_the_prompts_anchor(cold, tiny, ledger, holder):
    """P/D on one engine: a prefill leg computes the first token and stores; a decode leg of prompt + that token
    resumes from a snapshot and recomputes its tail through the consumer layers, anchored at a = L − 134 of the
    request's prompt (700), not of its own 701 tokens: the cold run's tokens, one by one (rule 10)."""
    tiny.clear_device_cache()
    first, _, _ = run_request(tiny, ledger, PROMPT, request_id="pd-prefill", max_tokens=1, state_ledger=holder)
    assert first == cold[0][:1]
    tiny.clear_device_cache()
    rest, usage, d = run_request(tiny, ledger, PROMPT + first, request_id="pd-decode", max_tokens=31,
                                 state_ledger=holder, prompt_len=len(PROMPT))
    assert d.kind is HitKind.SNAPSHOT and d.hit_tokens == 512 == usage.cached_tokens   # the tail [512, 701) computed
    assert first + rest == cold[0]


def test_next_turn_hits_the_decode_replica(cold, tiny, ledger, holder):
    turn2 = PROMPT + cold[0] + [t % 32000 for t in prompt(200, seed=4)]
    tiny.clear_device_cache()
    _, usage, d = run_request(tiny, ledger, turn2, request_id="turn2", max_tokens=1, state_ledger=holder)
    assert d.kind is HitKind.SNAPSHOT and d.hit_tokens == 640 == usage.cached_tokens  # boundary 640 < 700 + 32
    reference = tiny.model.new_state(len(turn2))  # the model's own cold prefill of turn 2, no device cache
    cold2 = run(tiny.model, reference, torch.tensor(turn2), chunk=512)
    assert _rel(tiny.first_logits["turn2"], cold2[-1]) <= 1e-4, "a hit on decode-written KV gives the cold answer"


def test_unreachable_holder_lowers_to_an_exact_replay(cold, ledger, holder, directory):
    """Another engine pulls the snapshot from the holder; with the holder gone it resumes exactly at once."""
    from kvledger.engine.engine import Engine

    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=0, pull_timeout_s=1.0) as puller:
        engine = Engine("tiny-v4", block_ledger=ledger, state_ledger=puller, kv_cache_bytes=16 << 20)
        engine.record_logits = True
        try:
            out, usage, d = run_request(engine, ledger, PROMPT, request_id="pulled", max_tokens=8, state_ledger=puller)
            assert d.kind is HitKind.SNAPSHOT and usage.hit_kind == "snapshot" and out == cold[0][:8]
            holder.server.stop()
            engine.clear_device_cache()
            t0 = time.monotonic()
            got, usage, d = run_request(engine, ledger, PROMPT, request_id="gone", max_tokens=8, state_ledger=puller)
            assert d.kind is HitKind.SNAPSHOT  # the directory still names the holder
            # rule 3′: lowered to an exact replay over the blocks (0 tokens reported), not a fallback
            assert usage.hit_kind == "replay" and usage.cached_tokens == 0 and time.monotonic() - t0 < 20
            assert torch.equal(engine.first_logits["gone"], cold[1]) and got == cold[0][:8]
        finally:
            engine.close()


@pytest.mark.parametrize("mode", ["exact", "fallback", "replay"])
def test_lowered_hit_on_device_blocks(cold, tiny, ledger, holder, mode):
    """Blocks 0-1 come from the device prefix cache and the fetch of blocks 2-3 dies: the decision is
    lowered to L1 = 256. tiny-v4 by default replays exactly from 0 over blocks 0-1 (rule 3′: no block is
    rewritten, the answer is the cold one, bit for bit). As V4 decides, a fallback recomputes block 1 into
    the spare (the cached one stays intact); a replay reads block 1 as cached. Each answer is the one of
    that decision made upfront."""
    import os
    import signal

    from kvledger.core import chain_keys, decide_hit, exact_replay
    from kvledger.engine.api import EngineRequest, SamplingParams

    spec = approximate(SPEC) if mode == "fallback" else SPEC
    tiny.loader.replay, tiny.loader.spec = mode == "replay", spec
    try:
        tiny.clear_device_cache()
        run_request(tiny, ledger, PROMPT[:300], request_id=f"short-{mode}", max_tokens=1, state_ledger=None)
        os.kill(tiny.fetcher.pid, signal.SIGKILL)
        time.sleep(0.2)
        rid = f"lowered-{mode}"
        _, usage, d = run_request(tiny, ledger, PROMPT, request_id=rid, max_tokens=1, state_ledger=holder)
        assert d.kind is HitKind.SNAPSHOT and usage.hit_kind == ("fallback" if mode == "fallback" else "replay")
        assert usage.cached_tokens == {"exact": 0, "fallback": 128, "replay": 256}[mode]
        tiny.clear_device_cache()
        upfront = exact_replay(len(PROMPT), 2, SPEC) if mode == "exact" else \
            decide_hit(len(PROMPT), 2, set(), spec, replay=mode == "replay")
        tiny.add_request(EngineRequest(f"upfront-{mode}", PROMPT, chain_keys(PROMPT, SPEC), upfront,
                                       SamplingParams(max_tokens=1)))
        while tiny.has_unfinished():
            tiny.step()
        tiny.check_integrity()
        assert _rel(tiny.first_logits[rid], tiny.first_logits[f"upfront-{mode}"]) <= 1e-4
        if mode == "exact":
            assert torch.equal(tiny.first_logits[rid], cold[1])
    finally:
        tiny.loader.replay, tiny.loader.spec = False, SPEC


def test_an_approximate_request_stores_nothing_that_a_later_one_could_take_as_exact(cold, tiny, ledger, holder):
    """Rule 9. B shares 3 blocks with the cold prompt and has no snapshot at L1 = 384: asked as V4 decides,
    it falls back (windows truncated at 256). It may answer approximately, but it stores no snapshot, puts
    no block from 256 on and offers none to the device cache. C, the same prompt decided by tiny-v4's own
    rule, then finds nothing of B's: its answer is the cold one, bit for bit. (Before rule 9, B's windows
    became snapshots at 768 and 896, and C was served a 'snapshot' hit computed from truncated windows.)"""
    from kvledger.core import chain_keys

    tiny.clear_device_cache()   # else the cold prompt's block 2 (exact, B's block 2 too) may be there already
    b_prompt = PROMPT[:400] + [t % 32000 for t in prompt(500, seed=9)]
    _, usage, d = run_request(tiny, ledger, b_prompt, request_id="approx-b", max_tokens=40, state_ledger=holder,
                              spec=approximate(SPEC))
    assert d.kind is HitKind.FALLBACK and d.truncate_from == 256 and usage.hit_kind == "fallback"
    keys = chain_keys(b_prompt, SPEC)
    # (snapshots at 128 and 256 are the exact ones of earlier prompts with the same first blocks)
    assert {p for p in holder.positions(keys) if p > 256} == set(), "B's truncated windows became snapshots"
    assert ledger.match_tokens(b_prompt, SPEC)[1] == 3, "B's blocks computed after the truncation were stored"
    assert tiny.pool.cached_prefix(keys) == 2, "B's recomputed blocks entered the device prefix cache"
    _, ref_usage, _ = run_request(tiny, ledger, b_prompt, request_id="approx-ref", max_tokens=1, namespace="ref")
    assert ref_usage.hit_kind == "miss"
    _, usage, d = run_request(tiny, ledger, b_prompt, request_id="approx-c", max_tokens=1, state_ledger=holder)
    assert usage.hit_kind != "fallback" and d.exact
    assert torch.equal(tiny.first_logits["approx-c"], tiny.first_logits["approx-ref"]), usage.hit_kind
