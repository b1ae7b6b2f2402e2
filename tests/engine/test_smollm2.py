"""SmolLM2-135M on the block ledger: a hit gives the cold answer; faults give the cold answer too.

One cold prefill of a 500-token prompt is the reference (logits and 32 greedy tokens); the other
scenarios reuse its blocks (copied under other namespaces where a test damages them).

"The cold answer" is exact within float32 rounding, not bit for bit: a hit computes its last rows
in GEMMs of another row count than the cold prefill, and MKL may round those differently (by CPU
and by shape). Reordering a float32 sum of K terms moves it by at most about K·2⁻²⁴ of the sum of
the terms' magnitudes, typically √K·2⁻²⁴ (K ≤ 1,536 here: ≤ 1e-4 worst case per product, ~2e-6
typical), so the bound is max |Δlogit| ≤ 1e-4 · max |logit|, and the greedy tokens must be equal.
test_kernel_paths.py runs this file under another MKL kernel path too."""

import os
import signal
import time

import pytest

from kvledger.core import HitKind
from kvledger.entrypoint.check import check_prompt
from tests.engine.helpers import drain, prompt, run_request

PROMPT = prompt(500)
B = 128


@pytest.fixture(scope="module")
def cold(smollm2, ledger):
    out, usage, decision = run_request(smollm2, ledger, PROMPT, request_id="cold", max_tokens=32)
    assert decision.kind is HitKind.MISS and usage.cached_tokens == 0 and usage.completion_tokens == 32
    return out, smollm2.first_logits["cold"]


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _copy_namespace(ledger, smollm2, namespace):
    """The default namespace's prompt blocks stored again under `namespace` (same KV, other keys)."""
    import numpy as np

    from kvledger.core import chain_keys

    src, dst = chain_keys(PROMPT, smollm2.spec), chain_keys(PROMPT, smollm2.spec, namespace)
    bufs = [bytearray(smollm2.spec.block_bytes()) for _ in src]
    assert ledger.read_prefix(src, bufs) == len(src)
    ledger.put_chain(dst, [np.frombuffer(b, np.uint8) for b in bufs], namespace=namespace)


def test_full_hit_matches_cold(cold, smollm2, ledger):
    out, logits = cold
    smollm2.clear_device_cache()
    streamed = smollm2.streamed_hits
    hit, usage, decision = run_request(smollm2, ledger, PROMPT, request_id="hit", max_tokens=32)
    assert decision.kind is HitKind.FULL and usage.cached_tokens == 384 == decision.hit_tokens
    assert usage.timings["fetch_s"] > 0 and "swapin_s" not in usage.timings   # read straight into its blocks
    # alone in the engine: its first forward ran while the blocks arrived, waiting per layer (loader.py)
    assert smollm2.streamed_hits == streamed + 1 and "fetch_wait_s" in usage.timings
    assert usage.fetch_bytes == 3 * smollm2.spec.block_bytes()
    assert _rel_err(smollm2.first_logits["hit"], logits) <= 1e-4
    assert hit == out


def test_a_hit_through_staging_and_swap_in_matches_cold(cold, ledger):
    """The device path (`fetch_into="staging"`, the default off the CPU): the blocks land in a staging area and
    are swapped in layer by layer during the first forward. Same answer as cold."""
    from kvledger.engine.engine import Engine

    out, logits = cold
    engine = Engine("smollm2-135m", block_ledger=ledger, kv_cache_bytes=96 << 20, fetch_into="staging")
    engine.record_logits = True
    try:
        hit, usage, decision = run_request(engine, ledger, PROMPT, request_id="staged", max_tokens=32)
        assert decision.kind is HitKind.FULL and usage.cached_tokens == 384
        assert usage.timings["fetch_s"] > 0 and usage.timings["swapin_s"] > 0
        assert _rel_err(engine.first_logits["staged"], logits) <= 1e-4
        assert hit == out
        engine.check_integrity()
    finally:
        engine.close()


def test_next_turn_hits_decode_blocks(cold, smollm2, ledger):
    out, _ = cold
    turn2 = PROMPT + out + prompt(100, seed=1)
    smollm2.clear_device_cache()
    _, usage, decision = run_request(smollm2, ledger, turn2, request_id="turn2", max_tokens=1)
    assert decision.hit_tokens == 512 > 384  # block [384, 512) was written at the end of the decode
    assert usage.cached_tokens == 512


def test_corrupt_block_recomputes(cold, smollm2, ledger):
    out, _ = cold
    _copy_namespace(ledger, smollm2, "corrupt")
    seg = next(p for p in (ledger.store.root / "segments").rglob("*.kvs") if b"corrupt" in p.read_bytes()[:4096])
    size, bb = seg.stat().st_size, smollm2.spec.block_bytes()
    with open(seg, "r+b") as f:  # damage block 1 of 3
        f.seek(size - 2 * bb + 1000)
        f.write(b"\xff" * 64)
    smollm2.clear_device_cache()
    streamed = smollm2.streamed_hits
    got, usage, decision = run_request(smollm2, ledger, PROMPT, request_id="corrupt", namespace="corrupt")
    assert decision.hit_tokens == 384 and usage.cached_tokens == 128
    assert got == out[:8]
    assert smollm2.streamed_hits == streamed + 1   # its forward over the damaged block was dropped


@pytest.mark.parametrize("stream_wait_s", [5.0, 0.2])
def test_a_fetcher_hung_under_a_streamed_forward_costs_a_recompute(cold, smollm2, ledger, monkeypatch,
                                                                    stream_wait_s):
    """The fetcher stops (SIGSTOP) before it reads a streamed hit's blocks (its job's deadline 0.65 s). With 5 s
    to wait, the forward waits at its first layer until that deadline, the fetcher is killed and restarted, and the
    forward's result is dropped. With 0.2 s, the forward is abandoned at 0.2 s (the engine steps on meanwhile) and
    the hit waits for its fetch as any other until the same deadline. Either way the prompt is computed: the cold
    answer, nothing reported cached."""
    out, _ = cold
    namespace = f"hung-{stream_wait_s}"
    _copy_namespace(ledger, smollm2, namespace)
    fetcher = smollm2.fetcher
    restarts, streamed, submit = fetcher.restarts, smollm2.streamed_hits, fetcher.submit
    stalled = smollm2.loader.faults["stream_stalled"]

    def stopped_submit(keys, rows, **kw):
        os.kill(fetcher.pid, signal.SIGSTOP)
        return submit(keys, rows, **kw)

    monkeypatch.setattr(fetcher, "submit", stopped_submit)
    monkeypatch.setattr(fetcher, "timeout_s", 0.5)
    monkeypatch.setattr(smollm2, "stream_wait_s", stream_wait_s)
    smollm2.clear_device_cache()
    t = time.monotonic()
    got, usage, decision = run_request(smollm2, ledger, PROMPT, request_id=namespace, namespace=namespace)
    assert decision.hit_tokens == 384 and usage.cached_tokens == 0 and got == out[:8]
    assert fetcher.restarts == restarts + 1 and time.monotonic() - t < 30
    if stream_wait_s > 1:
        assert smollm2.streamed_hits == streamed + 1 and usage.timings["fetch_wait_s"] >= 0.5
    else:
        assert smollm2.streamed_hits == streamed and smollm2.loader.faults["stream_stalled"] == stalled + 1
        assert 0.2 <= usage.timings["fetch_wait_s"] < 0.5


def test_a_hit_waits_for_its_fetch_while_another_request_decodes(cold, smollm2, ledger):
    """No request's tokens wait on another's fetch: a hit admitted while a request decodes is not streamed (its
    forward runs once its blocks are in) and still gives the cold answer."""
    from kvledger.engine.api import EngineRequest, SamplingParams

    out, _ = cold
    _copy_namespace(ledger, smollm2, "busy")
    smollm2.clear_device_cache()
    other = prompt(200, seed=9)
    keys, d = check_prompt(other, smollm2.spec, block_ledger=ledger, state_ledger=None)
    smollm2.add_request(EngineRequest("decoding", other, keys, d, SamplingParams(max_tokens=40, ignore_eos=True)))
    smollm2.step()   # its prefill: it decodes from now on
    streamed = smollm2.streamed_hits
    keys, d = check_prompt(PROMPT, smollm2.spec, block_ledger=ledger, state_ledger=None, namespace="busy")
    smollm2.add_request(EngineRequest("busy", PROMPT, keys, d, SamplingParams(max_tokens=8, ignore_eos=True),
                                      namespace="busy"))
    got, usages = [], {}
    while smollm2.has_unfinished():
        for event in smollm2.step():
            if event.request_id == "busy":
                got += event.token_ids
            usages[event.request_id] = event.usage or usages.get(event.request_id)
    smollm2.check_integrity()
    assert got == out[:8] and usages["busy"].cached_tokens == 384 and usages["decoding"].completion_tokens == 40
    assert smollm2.streamed_hits == streamed and "fetch_wait_s" not in usages["busy"].timings


def test_killed_fetcher_recomputes(cold, smollm2, ledger):
    out, _ = cold
    _copy_namespace(ledger, smollm2, "killed")
    restarts = smollm2.fetcher.restarts
    os.kill(smollm2.fetcher.pid, signal.SIGKILL)
    time.sleep(0.2)
    smollm2.clear_device_cache()
    got, usage, decision = run_request(smollm2, ledger, PROMPT, request_id="killed", namespace="killed")
    assert decision.hit_tokens == 384 and usage.cached_tokens == 0 and got == out[:8]
    assert smollm2.fetcher.restarts == restarts + 1
    smollm2.clear_device_cache()
    _, usage, _ = run_request(smollm2, ledger, PROMPT, request_id="after-restart", namespace="killed", max_tokens=1)
    assert usage.cached_tokens == 384  # the restarted fetcher serves the next hit


def test_batching_and_abort(cold, smollm2, ledger):
    """A new prompt joins while another decodes; an abort frees everything."""
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.entrypoint.check import check_prompt

    out, _ = cold
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    keys, d = check_prompt(PROMPT, smollm2.spec, block_ledger=ledger, state_ledger=None)
    smollm2.add_request(EngineRequest("a", PROMPT, keys, d, sampling))
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    joined_while_decoding = False
    steps = 0
    while smollm2.has_unfinished():
        if steps == 2:
            short = prompt(40, seed=2)
            k2, d2 = check_prompt(short, smollm2.spec, block_ledger=ledger, state_ledger=None)
            smollm2.add_request(EngineRequest("b", short, k2, d2, sampling))
            smollm2.add_request(EngineRequest("c", short, k2, d2, SamplingParams(max_tokens=50)))
        for e in smollm2.step():
            seen[e.request_id] += e.token_ids
            if e.request_id == "b" and len(seen["a"]) < 6:
                joined_while_decoding = True
            if e.request_id == "c" and len(seen["c"]) == 2:
                smollm2.abort("c")
            if e.request_id == "c" and e.finished:
                assert e.finish_reason == "abort"
        steps += 1
    smollm2.check_integrity()
    assert joined_while_decoding and seen["a"] == out[:6] and len(seen["b"]) == 6 and len(seen["c"]) == 2


def test_device_cache_raises_a_stale_check(cold, smollm2, ledger):
    """A CHECK made before the previous request's blocks reached the ledger says miss; the engine
    still takes the blocks its own device cache holds (no KV read), and reports them as device hits."""
    import numpy as np

    from kvledger.core import chain_keys, decide_hit
    from kvledger.engine.api import EngineRequest, SamplingParams

    out, _ = cold
    run_request(smollm2, ledger, PROMPT, request_id="warm-dev", max_tokens=1, namespace="dev")
    stale = decide_hit(len(PROMPT), 0, set(), smollm2.spec)   # what a CHECK before the write answered
    keys = chain_keys(np.asarray(PROMPT, dtype=np.uint32), smollm2.spec, "dev")
    smollm2.add_request(EngineRequest("stale", PROMPT, keys, stale, SamplingParams(max_tokens=32, ignore_eos=True),
                                      namespace="dev"))
    got, usage = drain(smollm2)
    assert usage.cached_tokens == 384 == usage.device_cached_tokens and usage.hit_kind == "full"
    assert got == out


WHOLE = prompt(4 * B, seed=7)   # a prompt of whole blocks: a hit reuses all 4 and computes its last token alone


@pytest.fixture(scope="module")
def cold_whole(smollm2, ledger):
    out, usage, decision = run_request(smollm2, ledger, WHOLE, request_id="whole-cold", max_tokens=16)
    assert decision.kind is HitKind.MISS and usage.computed_prompt_tokens == 4 * B
    return out, smollm2.first_logits["whole-cold"]


def test_a_hit_on_every_block_from_the_ledger_computes_one_token(cold_whole, smollm2, ledger):
    """Rule 3's full-attention cap, L − 1: the 4th block is fetched whole into a block the request owns and
    the last token's slot is rewritten; the answer is the cold one within float32 rounding."""
    out, logits = cold_whole
    smollm2.clear_device_cache()
    got, usage, decision = run_request(smollm2, ledger, WHOLE, request_id="whole-ledger", max_tokens=16)
    assert decision.kind is HitKind.FULL and decision.hit_tokens == usage.cached_tokens == 4 * B - 1
    assert usage.computed_prompt_tokens == 1 and usage.device_cached_tokens == 0
    assert usage.fetch_bytes == 4 * smollm2.spec.block_bytes()
    assert _rel_err(smollm2.first_logits["whole-ledger"], logits) <= 1e-4 and got == out


def test_a_hit_on_a_shared_device_block_writes_a_copy_of_it(cold_whole, smollm2, ledger):
    """Two requests at once take the 4 blocks from the device prefix cache: each writes its last token into a
    copy of the 4th block of its own (copy on write), so the cached block keeps the bytes it was found with."""
    import numpy as np

    from kvledger.core import chain_keys
    from kvledger.engine.api import EngineRequest, SamplingParams

    out, _ = cold_whole
    run_request(smollm2, ledger, WHOLE, request_id="whole-warm", max_tokens=1)   # the 4 blocks on the device
    keys = chain_keys(np.asarray(WHOLE, dtype=np.uint32), smollm2.spec)
    shared = smollm2.pool.by_key[keys[3]]
    before = [c.blocks_u8()[shared].clone() for c in smollm2.model.caches]
    for rid in ("whole-a", "whole-b"):
        _, decision = check_prompt(WHOLE, smollm2.spec, block_ledger=ledger, state_ledger=None)
        smollm2.add_request(EngineRequest(rid, WHOLE, keys, decision, SamplingParams(max_tokens=16, ignore_eos=True)))
    got: dict[str, list[int]] = {"whole-a": [], "whole-b": []}
    tables = {}
    while smollm2.has_unfinished():
        for event in smollm2.step():
            got[event.request_id] += event.token_ids
            if event.usage is not None and not event.finished:   # the first token: the prompt's hit
                assert event.usage.cached_tokens == event.usage.device_cached_tokens == 4 * B - 1
                assert event.usage.computed_prompt_tokens == 1
        for seq in smollm2.scheduler.running:
            tables.setdefault(seq.request_id, list(seq.block_table[:4]))
    smollm2.check_integrity()
    assert tables["whole-a"][:3] == tables["whole-b"][:3]                   # blocks only read: shared
    assert len({tables["whole-a"][3], tables["whole-b"][3], shared}) == 3   # the written one: a copy each
    assert all(bytes(c.blocks_u8()[shared]) == bytes(b) for c, b in zip(smollm2.model.caches, before))
    assert smollm2.pool.by_key[keys[3]] == shared
    assert got == {"whole-a": out, "whole-b": out}   # each the cold answer


def _tail_leg(smollm2, ledger, tokens, rid, *, tail_kv=None, max_tokens=31):
    """A P/D decode leg over `tokens` (prompt + first output token): the CHECK's decision, raised by the tail
    when one is given; (output, usage of the first event)."""
    from kvledger.core import with_tail
    from kvledger.engine.api import EngineRequest, SamplingParams

    keys, decision = check_prompt(tokens, smollm2.spec, block_ledger=ledger, state_ledger=None)
    if tail_kv is not None:
        decision = with_tail(decision, len(tokens), smollm2.spec)
    smollm2.add_request(EngineRequest(rid, tokens, keys, decision, SamplingParams(max_tokens=max_tokens,
                                                                                   ignore_eos=True), tail_kv=tail_kv))
    out, first = [], None
    while smollm2.has_unfinished():
        for event in smollm2.step():
            out += event.token_ids
            first = first or event.usage
    smollm2.check_integrity()
    return out, first


def test_a_prefill_leg_hands_its_tail_over_and_the_decode_leg_computes_one_token(cold, smollm2, ledger):
    """P/D: the prefill leg keeps the block its 500-token prompt ends in ([384, 500)); the decode leg over
    prompt + first token takes blocks 0–2 from the ledger and that tail, computes one token, and continues
    with the cold answer. Without the tail it computes the 117 tokens after block 2."""
    import numpy as np

    from kvledger.core import chain_keys, tail_key
    from kvledger.engine.api import EngineRequest, SamplingParams

    out, _ = cold
    smollm2.clear_device_cache()
    keys, decision = check_prompt(PROMPT, smollm2.spec, block_ledger=ledger, state_ledger=None)
    smollm2.add_request(EngineRequest("pd-prefill", PROMPT, keys, decision, SamplingParams(max_tokens=1),
                                      keep_tail=True))
    first, _ = drain(smollm2)
    assert first == out[:1]
    key = tail_key(chain_keys(np.asarray(PROMPT, dtype=np.uint32), smollm2.spec)[2], PROMPT[384:])
    tail = smollm2.tails.take(key)
    assert tail is not None and len(tail) == smollm2.spec.block_bytes() and smollm2.tails.take(key) is None

    smollm2.clear_device_cache()
    got, usage = _tail_leg(smollm2, ledger, PROMPT + first, "pd-decode", tail_kv=tail)
    assert usage.cached_tokens == 500 and usage.computed_prompt_tokens == 1 and usage.hit_kind == "full"
    assert first + got == out

    smollm2.clear_device_cache()
    got, usage = _tail_leg(smollm2, ledger, PROMPT + first, "pd-no-tail")
    assert usage.cached_tokens == 384 and usage.computed_prompt_tokens == 117 and first + got == out


def test_a_hit_past_the_cap_needs_its_tail(cold, smollm2, ledger):
    from kvledger.core import with_tail
    from kvledger.engine.api import EngineRequest, SamplingParams

    out, _ = cold
    tokens = PROMPT + out[:1]
    keys, decision = check_prompt(tokens, smollm2.spec, block_ledger=ledger, state_ledger=None)
    raised, sp = with_tail(decision, len(tokens), smollm2.spec), SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="tail"):
        smollm2.add_request(EngineRequest("no-tail", tokens, keys, raised, sp))
    with pytest.raises(ValueError, match="bytes of its last block"):
        smollm2.add_request(EngineRequest("short-tail", tokens, keys, raised, sp, tail_kv=b"\0" * 100))
    assert not smollm2.has_unfinished()
