"""A prompt chunk's attention (`prompt_attend`): its formula against float64, in float32 and in bf16; the checks
that decide whether bf16 is exact on this CPU (they must be able to say no); `onednn.Linear`'s many-row path."""

import pytest
import torch

from kvledger.engine.models import gemv, onednn, prompt_attend

HEADS, KV_HEADS, D = 6, 2, 32


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal grouped-query attention in float64: query head i reads KV head i // group."""
    end, group = start + q.shape[0], q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k[:end].double().repeat_interleave(group, 1), v[:end].double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) / D ** 0.5
    s = s.masked_fill(torch.arange(end)[None, :] > torch.arange(start, end)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vd)


def _padded(x: torch.Tensor, end: int) -> torch.Tensor:
    out = torch.zeros(prompt_attend.padded_length(end), *x.shape[1:], dtype=x.dtype)
    out[:end] = x[:end]
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("start, n", [(0, 300), (250, 50), (299, 1), (0, 1)])
def test_causal_is_the_formula_in_float32_and_within_bf16_rounding_in_bf16(start, n):
    g = torch.Generator().manual_seed(start + n)
    end = start + n
    q = torch.randn(n, HEADS, D, generator=g)
    k, v = torch.randn(end, KV_HEADS, D, generator=g).bfloat16(), torch.randn(end, KV_HEADS, D, generator=g).bfloat16()
    want = _reference(q, k, v, start)   # over the bf16 values: what the blocks hold
    got32 = prompt_attend.causal(q, k.float(), v.float(), start)
    assert got32.dtype == torch.float32 and got32.shape == (n, HEADS, D)
    assert _rel(got32, want) <= 1e-5
    got16 = prompt_attend.causal(q, _padded(k, end), _padded(v, end), start)   # keys in whole tiles, zeros after
    assert got16.dtype == torch.float32
    assert _rel(got16, want) <= 1e-2   # Q, the probabilities and the output rounded to bf16: 2⁻⁹ each


def test_where_the_check_passes_chunks_of_lengths_it_did_not_try_are_exact_too():
    """The check tries a few chunk lengths; the property it stands for is every length's."""
    if not prompt_attend.rows_invariant(HEADS, KV_HEADS, D, 1024, torch.bfloat16):
        pytest.skip("torch's bf16 attention is not row-invariant on this CPU: prompts attend in float32 here")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1000, HEADS, D, generator=g) * 3
    k = (torch.randn(1000, KV_HEADS, D, generator=g) * 3).bfloat16()
    v = torch.randn(1000, KV_HEADS, D, generator=g).bfloat16()
    whole = prompt_attend.causal(q, _padded(k, 1000), _padded(v, 1000), 0)
    for end, n in ((1000, 5), (1000, 130), (777, 3), (513, 512), (200, 199)):
        got = prompt_attend.causal(q[end - n:end], _padded(k, end), _padded(v, end), end - n)
        assert torch.equal(got, whole[end - n:end]), (end, n)


def test_the_attention_check_says_no_to_a_kernel_that_rounds_one_query_otherwise(monkeypatch):
    exact = prompt_attend.causal

    def one_query_apart(q, k, v, start):
        out = exact(q, k, v, start)
        return out if q.shape[0] > 1 else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(prompt_attend, "causal", one_query_apart)
    assert not prompt_attend.rows_invariant(HEADS, KV_HEADS, D, 600, torch.bfloat16)


def test_the_attention_check_says_no_where_the_kernel_fails(monkeypatch):
    def fails(*_):
        raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")

    monkeypatch.setattr(prompt_attend, "causal", fails)
    assert not prompt_attend.rows_invariant(HEADS, KV_HEADS, D, 600, torch.bfloat16)


class _ByRowCount(torch.nn.Module):
    """A product whose rounding depends on how many rows it has: float64 for a few rows, float32 for many."""

    in_features = 64

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor, steps: torch.Tensor | None = None) -> torch.Tensor:
        return (x.double() @ self.weight.double().T).float() if x.shape[0] < 8 else x @ self.weight.T


def test_the_matmul_check_says_no_to_a_product_that_rounds_by_row_count():
    assert not onednn.rows_invariant([_ByRowCount()], 300)


def test_a_prompts_rows_take_onednn_however_few_and_its_step_rows_the_few_rows_kernel(monkeypatch):
    """`onednn.Linear`: without `steps` (a decode step's rows) the few-rows kernel; with them, oneDNN for every
    row, then the step rows again in the few-rows kernel, so each row rounds as its kind does elsewhere."""
    if not (gemv.AVAILABLE and onednn.AVAILABLE):
        pytest.skip("needs both kvledger's gemv kernel and oneDNN (this CPU or build lacks one)")
    calls = []
    kernel = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    linear = onednn.Linear(64, 48, bias=False)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        steps_only, prompt = linear(x), linear(x, onednn.NO_STEPS)
        assert calls == [3]
        one = linear(x[:1], onednn.NO_STEPS)
        mixed = linear(x, torch.tensor([2]))
        assert calls == [3, 1]
        onednn_rows = linear._onednn(x)
    assert torch.equal(prompt, onednn_rows) and torch.equal(one, linear._onednn(x[:1].expand(2, -1))[:1])
    assert torch.equal(mixed[:2], onednn_rows[:2]) and torch.equal(mixed[2], steps_only[2])
    assert _rel(prompt, steps_only.double()) <= 1e-6
