"""Which models claim bit-exactness, and, for those that do not, whether a reply that differs from the reference
is a near-tie (float rounding flipped a greedy token) or wrong (`kvledger bench topology`).

A reply differs from the reference first at output index j. On a model that claims bit-exactness (DESIGN rule
10: the same logits bit for bit whatever the topology) that is wrong. On one exact only within float rounding,
it is a near-tie when the reference's two candidates at j were within rounding of each other:

    gap = (logit[want_j] − logit[got_j]) / max |logit|      the reference's logits at j, in this process
    near-tie  ⇔  |gap| ≤ NEAR_TIE_BOUND

The logits come from one engine with no cache, as the reference server's do: the model loaded here, the
prompt prefilled in one forward, then the reference's own tokens [0, j) fed one decode step at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Whether a model's engine claims the same greedy tokens bit for bit however a request is split (True), or only
# the same logits within float rounding (False). tiny-v4 and Gemma 3 compute every product in row tiles fixed by
# absolute positions (`fixed_rows`), so a chunk, a hit or a decode leg computes each position with the same
# floats; SmolLM2's float32 GEMMs (MKL, oneDNN) round differently with their row count, so a split request's
# logits move by up to the hit bound and a near-tie may flip a greedy token (models/llama.py).
BIT_EXACT: dict[str, bool] = {"tiny-v4": True, "gemma3-270m": True, "smollm2-135m": False}

# A near-tie's largest logit gap, of max |logit|: tests/engine/models/test_llama.py's HIT_BOUND, the rounding a
# split computation of SmolLM2 is held to.
NEAR_TIE_BOUND = 2e-4


@dataclass(slots=True, frozen=True)
class Verdict:
    """How one reply compares with its reference. Invariant: `first_diff` is None iff kind is "equal"; `gap` is
    set iff the model is not bit-exact and both replies have a token at `first_diff`."""

    kind: str                  # "equal", "near_tie" or "wrong"
    first_diff: int | None     # the first output index where the two replies differ
    gap: float | None = None   # (logit[want] − logit[got]) / max |logit| of the reference at first_diff


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first index where `got` and `want` differ (a shorter one differs where it ends); None when equal."""
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return None if j == len(got) == len(want) else j


def relative_gap(logits: Any, want: int, got: int) -> float:
    """(logits[want] − logits[got]) / max |logits|: a torch tensor [vocab] of one position."""
    return float((logits[want] - logits[got]) / logits.abs().max())


def classify(got: Sequence[int], want: Sequence[int], bit_exact: bool,
             logits_at: Callable[[int], Any], bound: float = NEAR_TIE_BOUND) -> Verdict:
    """`got` against the reference `want`. `logits_at(j)`: the reference's logits at output index j, asked only
    for a model that is not bit-exact and only at the first difference."""
    j = first_difference(got, want)
    if j is None:
        return Verdict("equal", None)
    if bit_exact or j >= min(len(got), len(want)):   # a reply cut short is no rounding
        return Verdict("wrong", j)
    gap = relative_gap(logits_at(j), want[j], got[j])
    return Verdict("near_tie" if abs(gap) <= bound else "wrong", j, gap)


class ReferenceLogits:
    """One engine of `model` with no cache, in this process: the logits the reference computes at output index j
    of a reply. Positions up to `max_tokens` (prompt + reply) fit its blocks."""

    def __init__(self, model: str, max_tokens: int) -> None:
        from kvledger.engine.models.registry import resolve

        entry = resolve(model)
        self.spec = entry.spec
        self.model = entry.load("cpu")
        self.blocks = -(-max_tokens // self.spec.block_size) + 1   # + the null block 0
        self.model.allocate(self.blocks, 1 if self.spec.has_swa else 0)

    def at(self, prompt: Sequence[int], reply: Sequence[int], j: int) -> Any:
        """Logits [vocab] predicting reply[j]: `prompt` in one forward, then reply[:j] one decode step each, as a
        no-cache engine runs the request."""
        import torch

        from kvledger.engine.models.base import Chunk
        from kvledger.engine.sequence import new_uid

        table, slot = torch.arange(1, self.blocks), 0 if self.spec.has_swa else -1
        seq, length = new_uid(), len(prompt)
        with torch.inference_mode():
            logits = self.model([Chunk(torch.tensor(list(prompt)), 0, table, slot, prompt_len=length, seq=seq)])[0]
            for i, token in enumerate(reply[:j]):
                logits = self.model([Chunk(torch.tensor([token]), length + i, table, slot, prompt_len=length,
                                           seq=seq)])[0]
        return logits
