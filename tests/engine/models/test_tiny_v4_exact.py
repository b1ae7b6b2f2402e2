"""A resume at a block boundary from ledger bytes (blocks + snapshot) gives the cold prefill's logits."""

import pytest
import torch

from kvledger.core.hit import HitKind, decide_hit, prefill_store_positions
from tests.engine.models.tiny_v4_paths import (
    ledger_blocks,
    max_rel_err,
    prefill_cold,
    prefill_hit,
    resume_state,
    run,
)
from kvledger.engine.models.tiny_v4_state import snapshot_bytes
from tests.engine.models.tiny_v4_helpers import cold_with_ledgers, prompt, tiny_v4  # noqa: F401


def greedy(model, state, first: torch.Tensor, n: int) -> list[int]:
    out, token = [], int(first.argmax())
    for _ in range(n):
        out.append(token)
        token = int(model.step(state, torch.tensor([token])).argmax())
    return out


def test_resume_at_every_boundary_equals_cold(tiny_v4):  # noqa: F811
    tokens = prompt(650, seed=3)
    cold = cold_with_ledgers(tiny_v4, tokens)
    positions = [p for p in cold.snapshots if p <= len(tokens) - tiny_v4.spec.reserve_tokens]
    assert positions == [128, 256, 384, 512]
    for p in positions:
        state = resume_state(tiny_v4, len(tokens), p, cold.blocks[:p // 128], cold.snapshots[p])
        logits = run(tiny_v4, state, tokens[p:], all_logits=True)
        err = max_rel_err(logits, cold.logits)
        assert err <= 1e-4, f"resume at {p}: max rel err {err:.2e}"
        assert torch.equal(logits, cold.logits), f"resume at {p} is not bit-exact (err {err:.2e})"


@pytest.mark.parametrize(("head", "chunk"), [(0, 100), (210, 3), (250, 1)])
def test_chunking_changes_no_float(tiny_v4, head, chunk):  # noqa: F811
    """Chunks that cut tiles and groups anywhere (after `head` tokens in one chunk) compute the same floats."""
    tokens = prompt(300, seed=4)
    _, whole = prefill_cold(tiny_v4, tokens, all_logits=True)
    state = tiny_v4.new_state(len(tokens))
    parts = [run(tiny_v4, state, tokens[:head], all_logits=True), run(tiny_v4, state, tokens[head:], chunk=chunk,
                                                                      all_logits=True)]
    chunked = torch.cat([part for part in parts if part is not None])
    assert torch.equal(chunked, whole), f"chunk {chunk}: max rel err {max_rel_err(chunked, whole):.2e}"


def test_identical_retry_hits_the_cap_snapshot_and_decodes_the_same(tiny_v4):  # noqa: F811
    spec, tokens = tiny_v4.spec, prompt(600, seed=5)
    state, cold = prefill_cold(tiny_v4, tokens)
    c, p = prefill_store_positions(len(tokens), spec)
    snapshots = {pos: snapshot_bytes(state, spec, pos) for pos in (c, p)}  # both fit the 396 ring
    blocks = ledger_blocks(tiny_v4, state, len(tokens) // 128)
    decision = decide_hit(len(tokens), len(blocks), set(snapshots), spec)
    assert decision.kind is HitKind.SNAPSHOT and decision.hit_tokens == c == 384
    hit_state, hit = prefill_hit(tiny_v4, tokens, decision, blocks, snapshots[c])
    err = max_rel_err(hit, cold)
    assert err <= 1e-4, f"hit logits max rel err {err:.2e}"
    assert greedy(tiny_v4, hit_state, hit[-1], 32) == greedy(tiny_v4, state, cold[-1], 32)


def test_next_turn_after_decode_hits_past_the_first_prompt(tiny_v4):  # noqa: F811
    """Decode writes too: blocks and the replica window from decode serve the next turn exactly."""
    spec, first = tiny_v4.spec, prompt(370, seed=6)
    state, logits = prefill_cold(tiny_v4, first)
    replica, token, turn = {}, int(logits[-1].argmax()), first.tolist()
    while len(turn) < 390:  # decode across the boundary at 384: copy the window there (rule 4)
        turn.append(token)
        token = int(tiny_v4.step(state, torch.tensor([token])).argmax())
        if state.pos % 128 == 0:
            replica[state.pos] = snapshot_bytes(state, spec, state.pos)
    blocks = ledger_blocks(tiny_v4, state, state.pos // 128)
    second = torch.tensor(turn + prompt(130, seed=7).tolist())
    decision = decide_hit(len(second), len(blocks), set(replica), spec)
    assert decision.kind is HitKind.SNAPSHOT and decision.hit_tokens == 384 > len(first)
    _, hit = prefill_hit(tiny_v4, second, decision, blocks, replica[384], all_logits=True)
    _, cold = prefill_cold(tiny_v4, second, all_logits=True)
    err = max_rel_err(hit, cold)
    assert err <= 1e-4, f"next-turn hit logits max rel err {err:.2e}"
