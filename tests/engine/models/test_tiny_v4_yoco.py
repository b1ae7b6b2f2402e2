"""YoCo consumer layers: what they recompute on a resume, and truncation by mask vs compact."""

import pytest
import torch

from tests.engine.models.tiny_v4_paths import prefill_cold, rel_l2, resume_state, run
from tests.engine.models.tiny_v4_helpers import cold_with_ledgers, prompt, tiny_v4  # noqa: F401

CONSUMERS = range(4, 8)


def test_consumers_compute_from_the_anchor_only(tiny_v4):  # noqa: F811
    """Consumer windows hold [L − 134, L) after prefill; a resume recomputes exactly those, from nothing stored."""
    tokens = prompt(520, seed=10)
    cold = cold_with_ledgers(tiny_v4, tokens)
    anchor = len(tokens) - tiny_v4.spec.yoco_keep
    assert cold.state.anchor == anchor == 386 and cold.logits.shape[0] == 134
    for i in CONSUMERS:
        assert (cold.state.windows[i].start, cold.state.windows[i].end) == (anchor, len(tokens))
    state = resume_state(tiny_v4, len(tokens), 384, cold.blocks[:3], cold.snapshots[384])
    assert all(state.windows[i].end == state.windows[i].start == anchor for i in CONSUMERS)
    logits = run(tiny_v4, state, tokens[384:], all_logits=True)
    assert torch.equal(logits, cold.logits)
    for i in CONSUMERS:
        assert torch.equal(state.windows[i].latents, cold.state.windows[i].latents), f"consumer {i} window"
        assert torch.equal(state.entries[i], cold.state.entries[i]), f"consumer {i} entries"


def test_the_truncation_is_what_makes_a_resume_possible(tiny_v4):  # noqa: F811
    """Without the anchor the consumers would need encoder rows before P: different logits, and no resume."""
    tokens = prompt(400, seed=11)
    _, truncated = prefill_cold(tiny_v4, tokens)
    state = tiny_v4.new_state(len(tokens))
    for i in CONSUMERS:
        state.windows[i].start = 0
    state.anchor = 0
    full = run(tiny_v4, state, tokens)
    err = rel_l2(truncated, full)
    assert err > 1e-3, f"truncating the consumer windows at L − 134 changed the logits by only {err:.2e}"
    with pytest.raises(AssertionError, match="YoCo anchor"):
        tiny_v4.new_state(len(tokens), pos=384)


@pytest.mark.parametrize("chunk", [None, 100])
def test_mask_and_compact_agree(tiny_v4, chunk):  # noqa: F811
    tokens = prompt(600, seed=12)
    compact, compact_logits = prefill_cold(tiny_v4, tokens, chunk=chunk, all_logits=True)
    mask, mask_logits = prefill_cold(tiny_v4, tokens, chunk=chunk, all_logits=True, yoco="mask")
    assert mask.windows[4].start < mask.anchor, "mask mode computes the consumer rows before the anchor too"
    assert compact.windows[4].start == compact.anchor
    err = rel_l2(mask_logits, compact_logits)
    assert err <= 1e-5, f"mask vs compact logits: relative L2 {err:.2e}"
    for i in CONSUMERS:
        rows = mask.windows[i].rows(mask.anchor, len(tokens))
        assert rel_l2(rows, compact.windows[i].latents) <= 1e-5, f"consumer {i} window"
    for _ in range(3):
        a = tiny_v4.step(compact, torch.tensor([7]), yoco="compact")
        b = tiny_v4.step(mask, torch.tensor([7]), yoco="mask")
        assert rel_l2(b, a) <= 1e-5, "decode after mask vs compact"
