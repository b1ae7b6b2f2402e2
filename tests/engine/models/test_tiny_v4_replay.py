"""Rule 3 without a snapshot: fallback and bounded replay, their error against cold, and what they touch;
rule 3′'s exact replay (what tiny-v4 does by default), bit-exact."""

import torch

from kvledger.core.hit import HitKind, decide_hit, exact_replay
from tests.engine.models.tiny_v4_paths import prefill_hit, rel_l2
from kvledger.engine.models.tiny_v4_state import block_bytes
from tests.engine.helpers import approximate
from tests.engine.models.tiny_v4_helpers import cold_with_ledgers, prompt, tiny_v4  # noqa: F401

BOUND = 0.25  # relative L2 of the last logits vs cold; measured figures are in the messages


def test_fallback_recomputes_the_last_block_with_a_truncated_window(tiny_v4):  # noqa: F811
    tokens = prompt(700, seed=20)
    cold = cold_with_ledgers(tiny_v4, tokens)
    decision = decide_hit(len(tokens), len(cold.blocks), set(), approximate(tiny_v4.spec))
    assert decision.kind is HitKind.FALLBACK and (decision.block_hit_tokens, decision.recompute_from) == (512, 384)
    state, logits = prefill_hit(tiny_v4, tokens, decision, cold.blocks, all_logits=True)
    err = rel_l2(logits[-1], cold.logits[-1])
    assert 0 < err <= BOUND, f"fallback: relative L2 of the last logits vs cold = {err:.4f}"
    assert not state.exact and state.floor == 384


def test_replay_rebuilds_windows_only_and_keeps_the_blocks(tiny_v4):  # noqa: F811
    tokens = prompt(700, seed=20)
    cold = cold_with_ledgers(tiny_v4, tokens)
    decision = decide_hit(len(tokens), len(cold.blocks), set(), tiny_v4.spec, replay=True)
    assert decision.kind is HitKind.REPLAY and decision.hit_tokens == 512 and decision.truncate_from == 384
    state, logits = prefill_hit(tiny_v4, tokens, decision, cold.blocks, all_logits=True)
    err = rel_l2(logits[-1], cold.logits[-1])
    assert 0 < err <= BOUND, f"bounded replay: relative L2 of the last logits vs cold = {err:.4f}"
    for b in range(4):  # block KV in [0, L1) is reused, never recomputed or overwritten
        assert block_bytes(state, tiny_v4.layout, b) == cold.blocks[b], f"block {b} was overwritten"
    assert state.windows[0].start >= 384 and not state.exact


def test_a_first_block_fallback_is_a_cold_prefill(tiny_v4):  # noqa: F811
    """L1 = 128: s = 0, nothing is truncated, the answer is exact."""
    tokens = prompt(300, seed=21)
    cold = cold_with_ledgers(tiny_v4, tokens)
    for replay in (False, True):
        decision = decide_hit(len(tokens), 1, set(), tiny_v4.spec, replay=replay)
        assert decision.truncate_from is None
        state, logits = prefill_hit(tiny_v4, tokens, decision, cold.blocks, all_logits=True)
        assert torch.equal(logits, cold.logits) and state.exact


def test_exact_replay_from_zero_is_the_cold_prefill_and_keeps_the_blocks(tiny_v4):  # noqa: F811
    """Rule 3′ with blocks and no snapshot: windows rebuilt from 0 untruncated, entries read from the blocks."""
    tokens = prompt(700, seed=20)
    cold = cold_with_ledgers(tiny_v4, tokens)
    decision = exact_replay(len(tokens), len(cold.blocks), tiny_v4.spec)
    assert decision.exact and (decision.hit_tokens, decision.block_hit_tokens) == (0, 512)
    state, logits = prefill_hit(tiny_v4, tokens, decision, cold.blocks, all_logits=True)
    assert torch.equal(logits, cold.logits) and state.exact
    for b in range(4):
        assert block_bytes(state, tiny_v4.layout, b) == cold.blocks[b], f"block {b} was overwritten"
