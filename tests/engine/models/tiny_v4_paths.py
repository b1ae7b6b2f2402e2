"""tiny-v4's prefill paths from ledger bytes: cold, snapshot hit, fallback, bounded replay (rule 3).

The state at a block boundary P is (block bytes of every block before P) + (the snapshot at P).
What each path computes, for a prompt of L tokens and L1 = the decision's block_hit_tokens:

    path       state loaded                        computed                      exact
    cold       nothing                             [0, L) every layer            yes (the reference)
    snapshot   blocks [0, L1) + windows at L1      [L1, L)                       yes
    fallback   blocks [0, s), s = L1 − 128         [s, L), windows floored at s  no: the block [s, L1) is
                                                                                 recomputed from truncated windows
    replay     blocks [0, L1)                      [s, L1) encoder windows only  no: windows at L1 come
                                                   (entries reused, untouched),  from truncated windows
                                                   then [L1, L)
    exact      blocks [0, L1)                      [0, L1) encoder windows only  yes (rule 3′): nothing
    replay                                         (entries reused), [L1, L)     is truncated (s = 0)
In every path the consumer layers compute [a, L) with a = L − 134 >= L1 (`tiny_v4` docstring).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvledger.core.hit import HitDecision, HitKind
from kvledger.engine.models.tiny_v4 import TinyV4, YocoMode
from kvledger.engine.models.tiny_v4_state import SeqState, block_bytes, load_block, load_snapshot


def as_tokens(tokens: Sequence[int] | Tensor) -> Tensor:
    return tokens if isinstance(tokens, Tensor) else torch.tensor(list(tokens), dtype=torch.long)


def run(model: TinyV4, state: SeqState, tokens: Tensor, *, chunk: int | None = None, yoco: YocoMode = "compact",
        all_logits: bool = False) -> Tensor | None:
    """Forward `tokens` from state.pos in chunks of `chunk` tokens (None: one chunk); logits of the last chunk
    (with `all_logits`, of every row from the anchor on, across chunks)."""
    step = chunk or max(len(tokens), 1)
    outs = []
    for lo in range(0, len(tokens), step):
        out = model.step(state, tokens[lo:lo + step], yoco=yoco, all_logits=all_logits)
        if out is not None:
            outs.append(out)
    if not outs:
        return None
    return torch.cat(outs) if all_logits else outs[-1]


def prefill_cold(model: TinyV4, tokens: Sequence[int] | Tensor, **kw) -> tuple[SeqState, Tensor]:  # noqa: ANN003
    tokens = as_tokens(tokens)
    state = model.new_state(len(tokens))
    return state, run(model, state, tokens, **kw)


def ledger_blocks(model: TinyV4, state: SeqState, n_blocks: int) -> list[bytes]:
    """The block-ledger bytes of the first `n_blocks` blocks of a state."""
    return [block_bytes(state, model.layout, b) for b in range(n_blocks)]


def resume_state(model: TinyV4, prompt_len: int, position: int, blocks: Sequence[bytes],
                 snapshot: bytes | None, *, floor: int = 0) -> SeqState:
    """A state at `position` from ledger bytes: `blocks` (loaded in order) and the snapshot at `position`."""
    state = model.new_state(prompt_len, pos=position, floor=floor)
    for b, data in enumerate(blocks):
        load_block(state, model.layout, b, data)
    if snapshot is not None:
        load_snapshot(state, model.spec, snapshot)
    return state


def prefill_hit(model: TinyV4, tokens: Sequence[int] | Tensor, decision: HitDecision, blocks: Sequence[bytes],
                snapshot: bytes | None = None, **kw) -> tuple[SeqState, Tensor]:  # noqa: ANN003
    """The prefill a decision asks for, from ledger bytes (`blocks`: at least the decision's blocks)."""
    tokens = as_tokens(tokens)
    size, l1, s = model.spec.block_size, decision.block_hit_tokens, decision.recompute_from
    if decision.kind is HitKind.MISS:
        return prefill_cold(model, tokens, **kw)
    if decision.kind is HitKind.SNAPSHOT:
        assert snapshot is not None, "a snapshot hit needs the snapshot"
        state = resume_state(model, len(tokens), l1, blocks[:l1 // size], snapshot)
        return state, run(model, state, tokens[l1:], **kw)
    floor = decision.truncate_from or 0
    if decision.kind is HitKind.FALLBACK:
        state = resume_state(model, len(tokens), s, blocks[:s // size], None, floor=floor)
        return state, run(model, state, tokens[s:], **kw)
    assert decision.kind is HitKind.REPLAY, f"tiny-v4 has sliding windows: no {decision.kind} hit"
    state = resume_state(model, len(tokens), s, blocks[:l1 // size], None, floor=floor)
    assert model.step(state, tokens[s:l1], compress=False) is None, "replay computes no consumer row"
    return state, run(model, state, tokens[l1:], **kw)


def rel_l2(a: Tensor, b: Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def max_rel_err(a: Tensor, b: Tensor) -> float:
    """max |a − b| / max |b|: the figure the bench reports as hit_logits_max_rel_err."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())
