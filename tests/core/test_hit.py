import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvledger import (
    HitKind,
    ModelSpec,
    decide_hit,
    decode_replica_positions,
    decode_store_position,
    prefill_store_positions,
)
from dataclasses import replace

from kvledger.core import (block_reach, blocks_spanned, cap_blocks, check_decision, checkpoint_positions,
                           decided_length, exact_replay, hit_cap, is_handed, lookup_hit, snapshot_candidates,
                           tail_parts, takes_tail, with_tail)

V4 = ModelSpec.preset("deepseek-v4.1-flash")
TINY = ModelSpec.preset("tiny-v4")
LLAMA = ModelSpec.preset("smollm2-135m")
GEMMA = ModelSpec.preset("gemma3-270m")
B = 128

lengths = st.integers(min_value=0, max_value=300_000)
blocks = st.integers(min_value=0, max_value=3_000)
positions = st.sets(st.integers(min_value=0, max_value=2_500).map(lambda k: k * B), max_size=8)
specs = st.sampled_from([V4, TINY, LLAMA])


# --- DESIGN.md's worked example, exactly ------------------------------------------

def test_worked_example_snapshot():
    d = decide_hit(131072, 1024, {130816}, V4)
    assert (d.hit_tokens, d.block_hit_tokens, d.swa_hit, d.recompute_from, d.truncate_from) == (
        130816, 130816, True, 130816, None)
    assert 131072 - d.recompute_from == 256


def test_worked_example_fallback():
    d = decide_hit(131072, 1024, set(), V4)
    assert (d.hit_tokens, d.block_hit_tokens, d.swa_hit, d.recompute_from, d.truncate_from) == (
        130688, 130816, False, 130688, 130688)
    assert d.kind is HitKind.FALLBACK


def test_worked_example_replay():
    d = decide_hit(131072, 1024, set(), V4, replay=True)
    assert (d.hit_tokens, d.block_hit_tokens, d.swa_hit, d.recompute_from, d.truncate_from) == (
        130816, 130816, False, 130688, 130688)
    assert d.replay and 130816 - d.recompute_from == 128


def test_only_the_snapshot_at_l1_counts():
    d = decide_hit(131072, 1024, {130688, 1024, 0}, V4)
    assert d.kind is HitKind.FALLBACK and d.hit_tokens == 130688


def test_short_prompts_never_hit():
    for L in (0, 1, 133, 134, 261):
        assert decide_hit(L, 10, {128}, V4).hit_tokens == 0
    assert decide_hit(262, 10, {128}, V4).hit_tokens == 128  # (262 - 134) // 128 * 128 = 128


def test_full_attention_needs_no_snapshot():
    d = decide_hit(1000, 100, set(), LLAMA)
    assert d.kind is HitKind.FULL and d.hit_tokens == d.recompute_from == 896 and d.truncate_from is None
    assert decide_hit(257, 2, set(), LLAMA).hit_tokens == 256  # R = 1: only the last token is computed



@pytest.mark.parametrize("L, cached, hit, blocks", [
    (4096, 32, 4095, 32),   # hit_cap's worked example: a prompt of whole blocks, all cached: one token computed
    (4096, 31, 3968, 31),   # its last block absent: block-aligned
    (4000, 31, 3968, 31),   # the tail after the last whole block is in no block
    (4096, 10, 1280, 10),   # blocks run out first: the cap does not matter
    (1, 0, 0, 0),
    (129, 1, 128, 1),
])
def test_a_full_attention_hit_ends_at_l_minus_1_when_every_block_is_present(L, cached, hit, blocks):
    d = decide_hit(L, cached, (), LLAMA)
    assert d.hit_tokens == d.block_hit_tokens == d.recompute_from == hit
    assert d.cap == hit_cap(L, LLAMA) == max(min(L - 1, L // B * B), 0)
    assert blocks_spanned(d.reused_block_tokens, LLAMA) == blocks and cap_blocks(L, LLAMA) == L // B


@given(lengths, blocks)
def test_the_l_minus_1_cap_only_adds_the_last_block_of_whole_block_prompts(L, cached):
    hit = decide_hit(L, cached, (), LLAMA).hit_tokens
    aligned = min(min(cached, L // B) * B, max(L - 1, 0) // B * B)   # a block-aligned cap's hit
    assert hit == aligned or (L % B == 0 and cached * B >= L and hit == L - 1 == aligned + B - 1)


def test_a_windowed_model_computes_its_last_r_tokens():
    assert decide_hit(4096, 32, (), TINY).block_hit_tokens % B == 0 and hit_cap(4096, TINY) % B == 0

def test_fallback_to_zero_is_not_a_truncation():
    d = decide_hit(400, 1, set(), V4)
    assert (d.hit_tokens, d.recompute_from, d.truncate_from) == (0, 0, None)


def test_negative_inputs_are_refused():
    with pytest.raises(ValueError):
        decide_hit(-1, 0, set(), V4)
    with pytest.raises(ValueError):
        decide_hit(100, -1, set(), V4)


# --- invariants --------------------------------------------------------------------

def _cap(L: int, spec: ModelSpec) -> int:
    """Rule 3's cap: a windowed model computes its last R tokens; a full-attention one only its last token."""
    return max((L - spec.reserve_tokens) // B * B if spec.has_swa else min(L - 1, L // B * B), 0)


def _l1(L: int, cached: int, spec: ModelSpec) -> int:
    return min(cached * B, _cap(L, spec))


@given(lengths, blocks, positions, specs, st.booleans())
def test_hit_invariants(L, cached, snaps, spec, replay):
    d = decide_hit(L, cached, snaps, spec, replay=replay)
    l1 = _l1(L, cached, spec)
    assert d.cap == _cap(L, spec)
    assert 0 <= d.hit_tokens <= d.block_hit_tokens <= l1
    at_l_minus_1 = not spec.has_swa and d.hit_tokens == d.block_hit_tokens == L - 1   # a prompt of whole blocks
    assert (d.hit_tokens % B == 0 and d.block_hit_tokens % B == 0) or at_l_minus_1
    assert d.hit_tokens <= cached * B
    assert d.recompute_from <= d.hit_tokens < L or (d.hit_tokens == 0 and d.recompute_from == 0)
    assert d.truncate_from is None or (d.truncate_from == d.recompute_from > 0)
    assert d.exact == (d.truncate_from is None)
    if d.swa_hit or not spec.has_swa:
        assert d.hit_tokens == d.recompute_from == d.block_hit_tokens
        assert not d.swa_hit or d.block_hit_tokens in snaps
    approximate = replay or spec.approximate_fallback
    if not spec.has_swa or approximate or l1 in snaps:   # rule 3: L1 decides, and only the snapshot there
        assert d.block_hit_tokens == l1
        assert d.swa_hit == (spec.has_swa and l1 > 0 and l1 in snaps)
        if not d.swa_hit and spec.has_swa and l1:
            assert d.recompute_from == l1 - B  # at most one block is recomputed or replayed
    else:   # rule 3′: an exact resume from the latest snapshot below L1, or a miss; never a truncation
        q = max((p for p in snaps if 0 < p < l1), default=0)
        assert d.exact and d.hit_tokens == d.block_hit_tokens == d.recompute_from == q
        assert d.kind is (HitKind.SNAPSHOT if q else HitKind.MISS) and d.swa_hit == (q > 0)


@given(lengths, blocks, positions, specs)
def test_replay_never_recomputes_block_kv(L, cached, snaps, spec):
    plain = decide_hit(L, cached, snaps, spec)
    d = decide_hit(L, cached, snaps, spec, replay=True)
    assert d.hit_tokens == d.block_hit_tokens == _l1(L, cached, spec)  # block KV in [0, L1) is all reused
    assert d.reused_block_tokens == d.block_hit_tokens
    assert d.hit_tokens >= plain.hit_tokens
    if d.replay:
        assert d.block_hit_tokens - d.recompute_from == B and d.block_hit_tokens not in snaps


@given(lengths, blocks, positions, st.sampled_from([V4, LLAMA]), st.integers(min_value=0, max_value=2_500))
def test_snapshots_elsewhere_do_not_change_the_decision(L, cached, snaps, spec, other):
    """Rule 3 (a model that falls back, or one without windows): only the snapshot at L1 counts."""
    d = decide_hit(L, cached, snaps, spec)
    assume(other * B != d.block_hit_tokens)
    assert decide_hit(L, cached, snaps | {other * B}, spec) == d


@given(lengths, blocks, positions, st.integers(min_value=0, max_value=2_500))
def test_exact_models_resume_from_the_latest_snapshot_below_l1(L, cached, snaps, other):
    """Rule 3′ (tiny-v4): a snapshot above L1, or below the one the decision resumes from, changes nothing;
    one between them becomes the resume point."""
    d = decide_hit(L, cached, snaps, TINY)
    l1, extra = _l1(L, cached, TINY), other * B
    again = decide_hit(L, cached, snaps | {extra}, TINY)
    if extra > l1 or extra <= d.hit_tokens or extra == 0:
        assert again == d
    else:
        assert again.kind is HitKind.SNAPSHOT and again.hit_tokens == extra and again.exact


def test_exact_model_without_a_snapshot_at_l1():
    """tiny-v4, L = 1000 (cap 768), 7 blocks held: no snapshot at 768 → the one at 512, else a miss."""
    d = decide_hit(1000, 7, {256, 512, 896}, TINY)
    assert (d.kind, d.hit_tokens, d.block_hit_tokens, d.recompute_from, d.truncate_from) == (
        HitKind.SNAPSHOT, 512, 512, 512, None)
    assert decide_hit(1000, 7, set(), TINY).kind is HitKind.MISS
    assert decide_hit(1000, 7, set(), TINY, replay=True).kind is HitKind.REPLAY   # asked for: approximate
    assert snapshot_candidates(1000, 7, TINY) == [128, 256, 384, 512, 640, 768]
    assert snapshot_candidates(1000, 7, V4) == [768] and snapshot_candidates(1000, 7, LLAMA) == []


def test_exact_replay_keeps_the_blocks_and_truncates_nothing():
    d = exact_replay(1000, 7, TINY)
    assert (d.kind, d.hit_tokens, d.block_hit_tokens, d.recompute_from, d.truncate_from) == (
        HitKind.REPLAY, 0, 768, 0, None)
    assert d.exact and d.reused_block_tokens == 768
    assert exact_replay(1000, 0, TINY).kind is HitKind.MISS


@given(lengths, blocks, blocks, positions, specs)
def test_more_cached_blocks_never_hit_less(L, c1, c2, snaps, spec):
    lo, hi = sorted((c1, c2))
    assert decide_hit(L, lo, snaps, spec).hit_tokens <= decide_hit(L, hi, snaps, spec).hit_tokens


# --- store positions (rule 4) -------------------------------------------------------

def test_prefill_store_positions_examples():
    # (c, p) = (⌊(L − 134)/128⌋·128, ⌊(L − 1)/128⌋·128), zeros dropped
    assert [prefill_store_positions(L, V4) for L in (0, 1, 128, 129, 262, 263, 1000, 131072)] == [
        (), (), (), (128,), (128, 256), (128, 256), (768, 896), (130816, 130944)]
    assert prefill_store_positions(100_000, LLAMA) == ()


@given(st.integers(min_value=1, max_value=300_000))
def test_prefill_store_positions_are_the_cap_and_the_last_boundary(L):
    positions = prefill_store_positions(L, V4)
    assert list(positions) == sorted(set(positions)) and all(x > 0 and x % B == 0 for x in positions)
    cap = decide_hit(L, 10**9, set(), V4).cap
    assert (cap in positions) == (cap > 0)
    last = positions[-1] if positions else 0
    assert (last == 0 and L <= B) or last <= L - 1 < last + B
    ring = V4.kvstore_ring()  # 396: both windows [x − 134, x) lie in the last 396 prompt tokens
    assert all(x - V4.inference_ring() >= L - ring for x in positions)


@given(st.integers(min_value=1, max_value=300_000))
def test_an_identical_retry_hits_its_own_snapshot(L):
    d = decide_hit(L, L // B, set(prefill_store_positions(L, V4)), V4)
    assert d.kind in (HitKind.SNAPSHOT, HitKind.MISS) and d.hit_tokens == d.cap


def test_a_next_turn_hits_the_previous_turns_snapshot():
    turn1 = 1000
    positions = prefill_store_positions(turn1, V4)
    d = decide_hit(turn1 + 300, turn1 // B, set(positions), V4)
    assert positions == (768, 896) and d.kind is HitKind.SNAPSHOT and d.hit_tokens == 896


def test_decode_replica_positions():
    assert list(decode_replica_positions(200, 500, V4)) == [256, 384]
    assert decode_store_position(200, 500, V4) == 384
    assert list(decode_replica_positions(256, 383, V4)) == []  # 256 was reached by prefill, not crossed
    assert decode_store_position(256, 384, V4) == 384
    assert decode_store_position(10, 20, V4) is None
    assert list(decode_replica_positions(0, 10_000, LLAMA)) == []
    with pytest.raises(ValueError):
        decode_replica_positions(10, 5, V4)


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=10_000))
def test_replica_positions_are_the_crossed_boundaries(a, n):
    crossed = list(decode_replica_positions(a, a + n, V4))
    assert crossed == [x for x in range(a + 1, a + n + 1) if x % B == 0]


@pytest.mark.parametrize("bad", [1.0, 2.5, True, False, "3", None, float("nan")])
def test_decide_hit_refuses_non_integers(bad):
    spec = ModelSpec.preset("deepseek-v4.1-flash")
    with pytest.raises(ValueError, match="integer"):
        decide_hit(1000, bad, set(), spec)
    with pytest.raises(ValueError, match="integer"):
        decide_hit(bad, 1, set(), spec)


def test_decide_hit_validation_survives_python_O():
    """Explicit ValueErrors, not asserts: the same refusal under `python -O`."""
    import subprocess
    import sys

    code = ("from kvledger import ModelSpec, decide_hit\n"
            "s = ModelSpec.preset('deepseek-v4.1-flash')\n"
            "for bad in ((1000, 1.5), (1000, True), (-1, 1), (1000, -2)):\n"
            "    try:\n"
            "        decide_hit(bad[0], bad[1], set(), s)\n"
            "    except ValueError:\n"
            "        continue\n"
            "    raise SystemExit(f'accepted {bad}')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@given(lengths, blocks, positions, specs, st.booleans())
def test_every_decision_passes_the_engines_check(L, cached, snaps, spec, replay):
    check_decision(decide_hit(L, cached, snaps, spec, replay=replay), L, spec)
    if spec.has_swa:
        check_decision(exact_replay(L, cached, spec), L, spec)



@pytest.mark.parametrize("change", [
    {"cap": 896},                        # made for another prompt length
    {"hit_tokens": 1024},                # more than the cap
    {"hit_tokens": 900, "block_hit_tokens": 900, "recompute_from": 900},   # not block-aligned
    {"recompute_from": 128},             # computes less than it reuses... after the hit
    {"swa_hit": True},                   # a snapshot a full-attention model cannot have
    {"kind": HitKind.SNAPSHOT},
    {"truncate_from": 0},
])
def test_the_engines_check_refuses_a_decision_made_for_something_else(change):
    d = decide_hit(1100, 7, (), LLAMA)   # FULL at 896 of a 1,100-token prompt (cap 1024)
    check_decision(d, 1100, LLAMA)
    with pytest.raises(ValueError, match="not one core.decide_hit makes"):
        check_decision(replace(d, **change), 1100, LLAMA)
    with pytest.raises(ValueError):
        check_decision(d, 2000, LLAMA)


def test_the_engines_check_knows_which_kinds_a_model_has():
    snapshot = decide_hit(1000, 8, {768}, TINY)
    fallback = decide_hit(131072, 1024, (), V4)
    assert (snapshot.kind, fallback.kind) == (HitKind.SNAPSHOT, HitKind.FALLBACK)
    check_decision(snapshot, 1000, TINY)
    check_decision(fallback, 131072, V4)
    with pytest.raises(ValueError, match="needs sliding-window layers"):   # same cap, a model without windows
        check_decision(replace(snapshot, cap=hit_cap(1000, LLAMA)), 1000, LLAMA)
    with pytest.raises(ValueError, match="recomputes"):
        check_decision(replace(fallback, hit_tokens=fallback.block_hit_tokens), 131072, V4)
    with pytest.raises(ValueError, match="needs sliding-window layers"):
        check_decision(replace(fallback, cap=hit_cap(131072, LLAMA)), 131072, LLAMA)


# --- rules 3′ and 4′ on Gemma 3 (W = 512 > B, every window in the snapshot, R = 1) --------

GEMMA = ModelSpec.preset("gemma3-270m")


def test_gemma3_computes_only_its_last_token_and_v4_its_last_134():
    assert (GEMMA.reserve_tokens, V4.reserve_tokens, TINY.reserve_tokens, LLAMA.reserve_tokens) == (1, 134, 134, 1)
    assert [hit_cap(L, GEMMA) for L in (128, 129, 256, 2000, 2049)] == [0, 128, 128, 1920, 2048]


@pytest.mark.parametrize("L, cached, snaps, kind, hit", [
    (2000, 15, {1920}, HitKind.SNAPSHOT, 1920),                # the prompt's own snapshot at L1 = cap = 1920
    (2000, 12, {512, 1024, 1536, 1920}, HitKind.SNAPSHOT, 1536),   # 12 blocks held: L1 = 1536, a checkpoint there
    (2000, 11, {512, 1024, 1536}, HitKind.SNAPSHOT, 1024),     # none at L1 = 1408: the latest below, exactly
    (2000, 15, set(), HitKind.MISS, 0),                        # no snapshot: never the approximate fallback
    (2000, 15, {2048}, HitKind.MISS, 0),                       # above L1: no use
    (300, 2, {256}, HitKind.SNAPSHOT, 256),
    (256, 2, {128, 256}, HitKind.SNAPSHOT, 128),               # cap ⌊255/128⌋·128: the last token is computed
])
def test_gemma3_hit_table(L, cached, snaps, kind, hit):
    d = decide_hit(L, cached, snaps, GEMMA)
    assert (d.kind, d.hit_tokens) == (kind, hit)
    assert d.exact and d.recompute_from == d.hit_tokens == d.block_hit_tokens
    check_decision(d, L, GEMMA)


@pytest.mark.parametrize("L, every, expected", [
    (2000, 512, (512, 1024, 1536)),       # the docstring's example: p = c = 1920 is stored anyway
    (2048, 512, (512, 1024, 1536)),       # p = 1920
    (2049, 512, (512, 1024, 1536)),       # p = 2048 is the prompt's own
    (2000, 1024, (1024,)),
    (500, 512, ()),
    (2000, 0, ()),
])
def test_checkpoint_positions_table(L, every, expected):
    assert checkpoint_positions(L, GEMMA, every) == expected
    assert not set(expected) & set(prefill_store_positions(L, GEMMA))


def test_checkpoints_are_for_windowed_models_at_block_boundaries():
    assert checkpoint_positions(100_000, LLAMA, 512) == ()
    assert checkpoint_positions(1000, V4, 256) == (256, 512)   # V4: (c, p) = (768, 896)
    with pytest.raises(ValueError, match="block boundaries"):
        checkpoint_positions(2000, GEMMA, 500)


@given(st.integers(min_value=1, max_value=40_000), st.integers(min_value=0, max_value=40_000),
       st.integers(min_value=1, max_value=4_000), st.sampled_from([0, 512, 1024, 2048]))
def test_a_shared_document_resumes_at_most_one_period_back(la, shared, extra, every):
    """Prompt A (la tokens) is stored with its rule-4′ snapshots and a checkpoint every `every` tokens; prompt B
    shares A's first `shared` tokens, then differs. B's blocks match up to the shared full blocks; a snapshot
    counts for B only where its block key is B's too (at or below the shared full blocks). With checkpoints B
    resumes exactly at most `every` tokens before L1; without them (every = 0) it may miss outright."""
    shared = min(shared, la)
    lb = shared + extra
    common = shared // B
    stored = set(prefill_store_positions(la, GEMMA)) | set(checkpoint_positions(la, GEMMA, every))
    valid = {x for x in stored if x <= common * B}
    d = decide_hit(lb, min(common, la // B), valid, GEMMA)
    assert d.exact and d.kind in (HitKind.SNAPSHOT, HitKind.MISS)
    l1 = min(common * B, hit_cap(lb, GEMMA))
    if every:
        assert d.hit_tokens >= l1 - every


# --- a tail handed over (P/D) ----------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "hit", "raised"), [
    (301, 256, 300),    # blocks 0, 1 and the tail [256, 300): the last token alone is computed
    (50, 0, 49),        # no whole block: the tail is the prompt but its last token
    (257, 256, None),   # L − 1 = 256 is a block boundary: nothing between, hit_cap already says 256
    (301, 128, None),   # block 1 missing: the tail cannot be placed
    (129, 128, None),   # the same as 257 at one block
])
def test_a_tail_raises_a_full_attention_hit_to_the_last_token(prompt_len, hit, raised):
    spec = LLAMA
    d = decide_hit(prompt_len, hit // spec.block_size, set(), spec)
    got = with_tail(d, prompt_len, spec)
    if raised is None:
        assert got is None
        return
    assert (got.kind, got.hit_tokens, got.block_hit_tokens, got.recompute_from, got.cap) == (
        HitKind.FULL, raised, raised, raised, raised)
    check_decision(got, prompt_len, spec)   # the engine takes it
    with pytest.raises(ValueError, match="cap"):
        check_decision(got, prompt_len + 1, spec)   # for another length it is not a decision of this prompt


def test_v4_takes_no_tail():
    """V4's dropped windows are rebuilt from the last 134 tokens: its decode leg computes them."""
    assert not takes_tail(V4) and takes_tail(GEMMA) and takes_tail(LLAMA)
    assert with_tail(decide_hit(1000, 7, set(), V4), 1000, V4) is None


@pytest.mark.parametrize(("prompt_len", "blocks", "snapshots", "raised"), [
    (727, 5, {640}, 726),   # blocks 0–4, the snapshot at 640, the tail [640, 726) and the windows at 726
    (769, 6, {640}, 768),   # L − 1 a boundary: no block part, the windows at 768 (the prefill stored 640 only)
    (50, 0, set(), 49),     # no whole block: the tail is the prompt but its last token
    (727, 5, set(), 726),   # the snapshot at 640 gone: the tail's windows make it up
    (727, 4, {512}, None),  # block 4 missing: the tail cannot be placed
])
def test_a_tail_raises_a_windowed_hit_to_the_last_token(prompt_len, blocks, snapshots, raised):
    """A windowed decision's L1 stops at a snapshot, so the blocks held are given (`cached_blocks`)."""
    d = decide_hit(prompt_len, blocks, snapshots, GEMMA)
    shown = blocks * B == d.block_hit_tokens   # the decision shows every block held: no count needed
    assert with_tail(d, prompt_len, GEMMA) == (with_tail(d, prompt_len, GEMMA, blocks) if shown else None)
    got = with_tail(d, prompt_len, GEMMA, blocks)
    if raised is None:
        assert got is None
        return
    assert (got.kind, got.swa_hit, got.hit_tokens, got.block_hit_tokens, got.recompute_from, got.cap) == (
        HitKind.SNAPSHOT, True, raised, raised, raised, raised)
    assert is_handed(got, prompt_len, GEMMA) and not is_handed(d, prompt_len, GEMMA)
    check_decision(got, prompt_len, GEMMA)
    with pytest.raises(ValueError, match="cap"):
        check_decision(got, prompt_len - 1, GEMMA)   # one token shorter: L − 1 is not its cap


def test_an_approximate_decision_takes_no_tail():
    """Rule 9: a fallback's windows were truncated; a tail cannot make them exact."""
    d = decide_hit(727, 5, set(), V4)
    assert d.kind is HitKind.FALLBACK and not d.exact
    gemma_fallback = replace(GEMMA, approximate_fallback=True)
    d = decide_hit(727, 5, set(), gemma_fallback)
    assert d.kind is HitKind.FALLBACK and with_tail(d, 727, gemma_fallback) is None


def test_tail_parts():
    assert tail_parts(727, GEMMA) == (3 * 1024 * 128, 15 * 518 * 1024)
    assert tail_parts(769, GEMMA) == (0, 15 * 518 * 1024)
    assert tail_parts(501, LLAMA) == (LLAMA.block_bytes(), 0) and tail_parts(257, LLAMA) == (0, 0)


def test_a_later_leg_of_a_model_anchored_at_its_prompt_is_decided_on_that_prompt():
    """tiny-v4, L = 645 (YoCo anchor a = 511): its decode leg of 646 tokens would cap at 512, past a, where no
    snapshot holds the consumer windows; decided on the request's 645 it caps at 384. Gemma 3's and SmolLM2's
    legs are decided on what they compute: a decode leg reaches the blocks its prefill leg stored."""
    tiny = ModelSpec.preset("tiny-v4")
    assert hit_cap(646, tiny) == 512 > 645 - tiny.yoco_keep
    assert decided_length(646, 645, tiny) == 645 and hit_cap(645, tiny) == 384
    for name in ("gemma3-270m", "smollm2-135m"):
        assert decided_length(646, 645, ModelSpec.preset(name)) == 646
    with pytest.raises(AssertionError):
        decided_length(645, 646, tiny)   # a prompt longer than the tokens given is no leg of it


# --- the hit lookup (`lookup_hit`): candidates → the snapshot lookup → decide_hit, in one place ------------

class _Directory:
    """A snapshot lookup that holds `held` and records what it was asked."""

    def __init__(self, held: set[int]) -> None:
        self.held, self.asked = held, []

    def __call__(self, at):
        self.asked.append(list(at))
        return {p for p in at if p in self.held}


def test_lookup_asks_about_the_candidates_and_decides_on_the_answer():
    """tiny-v4, L = 1000 (cap 768), 7 blocks: asked about every boundary up to L1, no snapshot at 768 → 512."""
    directory = _Directory({256, 512, 896})
    found = lookup_hit(1000, 7, directory, TINY)
    assert directory.asked == [[128, 256, 384, 512, 640, 768]]
    assert found.decision == decide_hit(1000, 7, {256, 512, 896}, TINY)
    assert (found.decision.kind, found.decision.hit_tokens, found.l1) == (HitKind.SNAPSHOT, 512, 768)


def test_lookup_asks_only_about_l1_where_the_model_falls_back_or_replays():
    for spec, replay in ((V4, False), (TINY, True)):
        directory = _Directory(set())
        found = lookup_hit(1000, 7, directory, spec, replay=replay)
        assert directory.asked == [[768]] and found.l1 == found.decision.block_hit_tokens == 768


def test_lookup_asks_nothing_without_candidates_or_a_state_ledger():
    """No sliding-window layers, no block present, or a prompt under the cap: the directory is not asked."""
    directory = _Directory({128, 256})
    assert lookup_hit(1000, 7, directory, LLAMA).decision.hit_tokens == 896
    assert lookup_hit(1000, 0, directory, TINY).decision.kind is HitKind.MISS
    assert lookup_hit(100, 7, directory, TINY).decision.kind is HitKind.MISS
    assert directory.asked == []
    none = lookup_hit(1000, 7, None, TINY)   # no state ledger: no snapshot
    assert none.decision == decide_hit(1000, 7, set(), TINY) and none.l1 == 768


def test_a_lookup_that_answers_only_its_highest_find_decides_the_same():
    """`decide_hit` uses the snapshot at L1, else the latest below it: an answer of that one alone is enough."""
    highest = lambda at: {max(p for p in at if p in {256, 512})}   # noqa: E731
    assert lookup_hit(1000, 7, highest, TINY).decision == lookup_hit(1000, 7, _Directory({256, 512}), TINY).decision


def test_a_later_leg_is_looked_up_on_its_request_prompt():
    """tiny-v4, a decode leg of 646 tokens of a 645-token prompt: decided on 645 (cap 384), not 646 (cap 512)."""
    directory = _Directory({384, 512})
    found = lookup_hit(646, 5, directory, TINY, request_prompt_len=645)
    assert directory.asked == [[128, 256, 384]]
    assert found.decision == decide_hit(645, 5, {384, 512}, TINY) and found.l1 == 384


@given(lengths, blocks, positions, specs, st.booleans())
def test_lookup_is_decide_hit_over_what_the_directory_holds(L, cached, snaps, spec, replay):
    """Whatever the directory holds, the lookup decides as `decide_hit` over all of it, and its l1 is rule 3's L1
    (blocks present up to the cap), never below the decision's block_hit_tokens."""
    found = lookup_hit(L, cached, _Directory(snaps), spec, replay=replay)
    assert found.decision == decide_hit(L, cached, snaps, spec, replay=replay)
    assert found.l1 == _l1(L, cached, spec) == block_reach(L, cached, spec)
    assert found.decision.block_hit_tokens <= found.l1 <= max(found.decision.cap, 0)


def test_a_branch_point_is_where_the_blocks_reach_past_the_snapshot_a_prompt_resumes_from():
    """Rule 4″ (a): L1 when the decision resumes below it (no window there), on a windowed model only."""
    from kvledger.core import HitLookup, shared_prefix_positions

    no_window = lookup_hit(1161, 8, lambda at: (), GEMMA)
    assert (no_window.decision.hit_tokens, no_window.l1, no_window.branch_point(GEMMA)) == (0, 1024, 1024)
    at_l1 = lookup_hit(1161, 8, lambda at: (1024,), GEMMA)
    assert at_l1.decision.hit_tokens == 1024 and at_l1.branch_point(GEMMA) == 0
    below = lookup_hit(1161, 9, lambda at: (512,), GEMMA)   # resumes at 512, the blocks reach 1152
    assert below.decision.hit_tokens == 512 and below.branch_point(GEMMA) == 1152
    assert lookup_hit(1161, 8, None, LLAMA).branch_point(LLAMA) == 0   # full attention: no window to keep
    assert lookup_hit(1161, 0, lambda at: (), GEMMA).branch_point(GEMMA) == 0   # nothing stored: no branch
    # message ends add their last boundary; only what lies past the hit (the prefill computes through it)
    assert shared_prefix_positions(no_window, GEMMA, (1214, 300)) == (256, 1024, 1152)
    assert shared_prefix_positions(below, GEMMA, (1214, 300)) == (1152,)
    assert shared_prefix_positions(lookup_hit(1161, 8, None, LLAMA), LLAMA, (1214,)) == ()
    assert shared_prefix_positions(HitLookup(no_window.decision, 0), GEMMA, ()) == ()


def test_rule_4pp_positions_are_checkpoints_below_the_prompts_own():
    """What the engine snapshots of them: block boundaries below p, other than rule 4's own."""
    from kvledger.core import shared_prefix_positions

    lookup = lookup_hit(1500, 8, lambda at: (), GEMMA)
    shared = shared_prefix_positions(lookup, GEMMA, (1214,))
    assert shared == (1024, 1152)
    assert checkpoint_positions(1500, GEMMA, 0, also=shared) == (1024, 1152)
    assert checkpoint_positions(1160, GEMMA, 0, also=shared) == (1024,)   # 1152 is p, the prompt's own


def test_message_snapshots_are_the_first_message_and_the_latest_earlier_ones():
    """Rule 4″ (b): never the last message (the prompt's own end), at most MESSAGE_SNAPSHOTS of them."""
    from kvledger.core import MESSAGE_SNAPSHOTS, message_snapshot_indices

    assert MESSAGE_SNAPSHOTS == 2
    assert message_snapshot_indices(1) == ()            # one message ends where the prompt does
    assert message_snapshot_indices(2) == (0,)          # system + user: the system prompt's end
    assert message_snapshot_indices(3) == (0, 1)
    assert message_snapshot_indices(9) == (0, 7)        # the first and the latest earlier one
    with pytest.raises(ValueError):
        message_snapshot_indices(-1)
