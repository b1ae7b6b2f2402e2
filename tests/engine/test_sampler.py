"""Sampling: greedy, seeded draws, top-k / top-p filters, repetition penalty."""

import torch

from kvledger.engine.api import SamplingParams
from kvledger.engine.sampler import apply_repetition_penalty, filter_top_k_top_p, make_generator, sample_one


def test_greedy_and_seeded():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_one(logits, SamplingParams(max_tokens=1), [], None) == 1
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=7)
    a = [sample_one(logits, sp, [], g) for g in [make_generator(sp)] for _ in range(20)]
    b = [sample_one(logits, sp, [], g) for g in [make_generator(sp)] for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)[2:]).all()
    kept = filter_top_k_top_p(logits, 0, 0.5)  # p(4.0) ≈ 0.64 alone reaches 0.5
    assert not torch.isinf(kept[0]) and torch.isinf(kept[1:]).all()
    sp = SamplingParams(max_tokens=1, temperature=5.0, top_k=1, seed=1)
    assert {sample_one(logits, sp, [], make_generator(sp)) for _ in range(10)} == {0}


def test_repetition_penalty():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0] and logits.tolist() == [2.0, -2.0, 1.0]
