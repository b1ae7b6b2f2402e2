"""Next-token sampling: repetition penalty, then greedy or temperature with top-k and top-p.

Sampling runs on the host in float32 with each request's own generator. A seeded request's n-th draw takes a
generator seeded from (`SamplingParams.seed`, n) alone (`draw_generator`), so it draws the same tokens on any
device and on any topology: a P/D decode leg, a continuation on another engine or a preempted sequence draws its
n-th token as one engine running the whole request would (rule 10).
Whatever the parameters, a draw is well defined while one logit is finite: NaN logits are never
drawn, ±inf ones are clamped to float32's range (after the penalty and the temperature, which can
overflow), and every filter keeps the most likely token.
"""

from __future__ import annotations

import hashlib

import torch

from kvledger.engine.api import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """Tokens already in the sequence: positive logits divided by `penalty`, negative ones multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


class SamplingError(ValueError):
    """No logit is finite: there is nothing to draw from (this sequence fails, not the batch)."""


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN → −inf (never drawn), +inf → float32's largest value; SamplingError when nothing finite is left."""
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                              neginf=float("-inf"))
    if bool(torch.isneginf(logits).all()):
        raise SamplingError("no finite logit to sample from")
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top k, or outside the smallest set whose probability reaches top_p, → −inf.
    The most likely token always stays (a top_p that rounds to 0 in float32 keeps exactly it)."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, seen: list[int],
               generator: torch.Generator | None) -> int:
    """One token from float32 host logits [vocab]; SamplingError when no logit is finite."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(finite_logits(logits)))
    logits = filter_top_k_top_p(finite_logits(logits / params.temperature), params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A sequence's running generator: for unseeded sampling only (a seeded draw takes `draw_generator`'s)."""
    if params.greedy or params.seed is not None:
        return None
    g = torch.Generator(device="cpu")
    g.seed()
    return g


def draw_generator(params: SamplingParams, draw: int, running: torch.Generator | None) -> torch.Generator | None:
    """The generator of a request's `draw`-th sampled token (0: its first): seeded from (seed, draw) for a seeded
    request, whatever drew before it in this process; the sequence's `running` one otherwise."""
    if params.greedy or params.seed is None:
        return running
    digest = hashlib.blake2b(f"{params.seed}:{draw}".encode(), digest_size=8).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest, "little"))
    return g
