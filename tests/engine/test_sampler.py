"""Sampling: greedy, seeded draws, top-k / top-p filters, repetition penalty, parameters and logits that
once broke a draw."""

import pytest
import torch

from kvledger.engine.api import SamplingParams
from kvledger.engine.sampler import (SamplingError, apply_repetition_penalty, draw_generator, filter_top_k_top_p,
                                     make_generator, sample_one)


def test_greedy_and_seeded():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_one(logits, SamplingParams(max_tokens=1), [], None) == 1
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=7)
    a = [sample_one(logits, sp, [], draw_generator(sp, n, make_generator(sp))) for n in range(20)]
    b = [sample_one(logits, sp, [], draw_generator(sp, n, make_generator(sp))) for n in range(20)]
    assert a == b and len(set(a)) > 1


def test_a_seeded_draw_depends_on_the_seed_and_its_index_alone():
    """A later leg (P/D, a continuation elsewhere) draws its n-th token as one engine would, whatever it drew
    before: draws 10-19 alone are draws 10-19 of the whole run; another seed draws otherwise."""
    logits = torch.zeros(64)
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=7)
    whole = [sample_one(logits, sp, [], draw_generator(sp, n, None)) for n in range(20)]
    assert [sample_one(logits, sp, [], draw_generator(sp, n, None)) for n in range(10, 20)] == whole[10:]
    other = SamplingParams(max_tokens=1, temperature=1.0, seed=8)
    assert [sample_one(logits, other, [], draw_generator(other, n, None)) for n in range(20)] != whole


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


POISON = [   # each made torch.multinomial raise, and so failed every request of the batch
    {"top_p": 1e-300},                # 0 in float32: the top-p filter dropped every token
    {"repetition_penalty": 1e-40},    # a seen positive logit / 1e-40 → inf, softmax → NaN
    {"top_p": 1e-300, "top_k": 1, "repetition_penalty": 1e-40},
]


@pytest.mark.parametrize("poison", POISON, ids=range(len(POISON)))
def test_poison_parameters_still_draw_a_token(poison):
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    sp = SamplingParams(max_tokens=1, temperature=0.7, seed=3, **poison)
    g = make_generator(sp)
    drawn = {sample_one(logits, sp, [0, 1, 2], g) for _ in range(20)}
    assert drawn <= {0, 1, 2, 3}
    if poison == {"top_p": 1e-300}:
        assert drawn == {1}   # only the most likely token is left


def test_nan_and_inf_logits_are_never_a_failed_draw():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([nan, 1.0, inf, -inf, nan])
    for sp in (SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=1e-5, seed=1),
               SamplingParams(max_tokens=1, temperature=2.0, top_p=0.5, seed=1)):
        assert sample_one(logits, sp, [], make_generator(sp)) == 2
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    assert {sample_one(torch.tensor([nan, 2.0, nan, 2.0]), sp, [], g) for g in [make_generator(sp)]
            for _ in range(20)} == {1, 3}
    with pytest.raises(SamplingError):
        sample_one(torch.tensor([nan, -inf]), sp, [], make_generator(sp))


def test_filters_keep_the_most_likely_token():
    logits = torch.tensor([1.0, 9.0, 2.0])
    for top_k, top_p in ((0, 1e-300), (0, 1e-9), (1, 1e-300), (2, 0.0)):
        kept = filter_top_k_top_p(logits, top_k, top_p)
        assert not torch.isinf(kept[1]), (top_k, top_p)
