"""tiny-v4 on the engine with both ledgers: snapshot hits are exact, replay and fallback are bounded,
a next turn hits the decode replica, an unreachable state holder lowers the hit (rule 8), never hangs."""

import time

import pytest
import torch

from kvledger.core import HitKind, ModelSpec
from kvledger.engine.models.tiny_v4_paths import run
from kvledger.state.directory import MemoryDirectory
from kvledger.state.ledger import StateLedger
from tests.engine.helpers import prompt, run_request

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
    tiny.clear_device_cache()
    rid = f"no-snapshot-{replay}"
    _, usage, d = run_request(tiny, ledger, PROMPT, request_id=rid, max_tokens=1, state_ledger=None, replay=replay)
    assert d.kind is (HitKind.REPLAY if replay else HitKind.FALLBACK)
    assert usage.cached_tokens == (512 if replay else 384)
    err = _rel(tiny.first_logits[rid], cold[1])
    assert 0 < err < 0.2, err  # the truncated window's error (measured ~0.04 on this prompt)


def test_next_turn_hits_the_decode_replica(cold, tiny, ledger, holder):
    turn2 = PROMPT + cold[0] + [t % 32000 for t in prompt(200, seed=4)]
    tiny.clear_device_cache()
    _, usage, d = run_request(tiny, ledger, turn2, request_id="turn2", max_tokens=1, state_ledger=holder)
    assert d.kind is HitKind.SNAPSHOT and d.hit_tokens == 640 == usage.cached_tokens  # boundary 640 < 700 + 32
    reference = tiny.model.new_state(len(turn2))  # the model's own cold prefill of turn 2, no device cache
    cold2 = run(tiny.model, reference, torch.tensor(turn2), chunk=512)
    assert _rel(tiny.first_logits["turn2"], cold2[-1]) <= 1e-4, "a hit on decode-written KV gives the cold answer"


def test_unreachable_holder_falls_back(cold, ledger, holder, directory):
    """Another engine pulls the snapshot from the holder; with the holder gone it falls back at once."""
    from kvledger.engine.engine import Engine

    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=0, pull_timeout_s=1.0) as puller:
        engine = Engine("tiny-v4", block_ledger=ledger, state_ledger=puller, kv_cache_bytes=16 << 20)
        engine.record_logits = True
        try:
            out, usage, d = run_request(engine, ledger, PROMPT, request_id="pulled", max_tokens=8, state_ledger=puller)
            assert d.kind is HitKind.SNAPSHOT and usage.hit_kind == "snapshot" and out == cold[0][:8]
            _, _, fb = run_request(engine, ledger, PROMPT, request_id="fb", max_tokens=8, state_ledger=None)
            holder.server.stop()
            engine.clear_device_cache()
            t0 = time.monotonic()
            got, usage, d = run_request(engine, ledger, PROMPT, request_id="gone", max_tokens=8, state_ledger=puller)
            assert d.kind is HitKind.SNAPSHOT  # the directory still names the holder
            assert usage.hit_kind == "fallback" and usage.cached_tokens == 384 and time.monotonic() - t0 < 20
            assert _rel(engine.first_logits["gone"], engine.first_logits["fb"]) <= 1e-4
        finally:
            engine.close()


@pytest.mark.parametrize("replay", [False, True])
def test_lowered_hit_on_device_blocks(cold, tiny, ledger, holder, replay):
    """Blocks 0-1 come from the device prefix cache and the fetch of blocks 2-3 dies: the decision is
    lowered to L1 = 256. A fallback recomputes block 1 into the spare (the cached one stays intact);
    a replay reads block 1 as cached. Either way the answer is the one of that decision made upfront."""
    import os
    import signal

    from kvledger.core import chain_keys, decide_hit
    from kvledger.engine.api import EngineRequest, SamplingParams

    tiny.loader.replay = replay
    try:
        tiny.clear_device_cache()
        run_request(tiny, ledger, PROMPT[:300], request_id=f"short-{replay}", max_tokens=1, state_ledger=None)
        os.kill(tiny.fetcher.pid, signal.SIGKILL)
        time.sleep(0.2)
        rid = f"lowered-{replay}"
        _, usage, d = run_request(tiny, ledger, PROMPT, request_id=rid, max_tokens=1, state_ledger=holder)
        assert d.kind is HitKind.SNAPSHOT and usage.hit_kind == ("replay" if replay else "fallback")
        assert usage.cached_tokens == (256 if replay else 128)
        tiny.clear_device_cache()
        upfront = decide_hit(len(PROMPT), 2, set(), SPEC, replay=replay)
        tiny.add_request(EngineRequest(f"upfront-{replay}", PROMPT, chain_keys(PROMPT, SPEC), upfront,
                                       SamplingParams(max_tokens=1)))
        while tiny.has_unfinished():
            tiny.step()
        tiny.check_integrity()
        assert _rel(tiny.first_logits[rid], tiny.first_logits[f"upfront-{replay}"]) <= 1e-4
    finally:
        tiny.loader.replay = False
