"""kvledger's kernel for a decode step's matmuls (`models/gemv.py`, `_gemv.c`): within float32 rounding of a
float64 product, the same bits whatever the thread count, on torch's own OpenMP runtime, and used by the
engine's `Linear` only where it applies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvledger.engine.models import gemv
from kvledger.engine.models.onednn import Linear
from tests.engine.models.thread_counts import under_thread_counts

pytestmark = pytest.mark.skipif(not gemv.AVAILABLE, reason="the kernel is not built, or this CPU lacks AVX2/FMA")

SHAPES = [(960, 576), (3072, 576), (576, 1536),   # SmolLM2's
          (13, 37), (3, 8), (4, 1), (1, 9), (49157, 64)]   # n and k off the kernel's steps of 4 rows, 8 lanes


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_the_product_is_a_float64_ones_to_float32_rounding(m, n, k):
    x, w = _case(m, n, k)
    with torch.inference_mode():
        y = gemv.gemv(x, w)
    want = x.double() @ w.double().T
    assert y.shape == (m, n) and y.dtype == torch.float32
    # each output sums k products: float32 rounding grows at most like k · 2⁻²⁴ of the sum of |products|
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((y.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("n,k", [(3072, 576), (49157, 64), (13, 37)])
def test_the_bits_are_the_same_for_any_thread_count(n, k):
    x, w = _case(3, n, k, seed=1)
    ys = under_thread_counts(lambda: gemv.gemv(x, w), (1, 2, 3, 7))
    assert all(torch.equal(ys[0], y) for y in ys[1:])


def test_it_runs_on_torchs_openmp_runtime_not_a_second_one():
    """Two OpenMP runtimes would be two thread pools spinning against each other on the same cores."""
    x, w = _case(1, 4096, 576)
    with torch.inference_mode():
        torch.ops.aten.mm(torch.randn(512, 512), torch.randn(512, 512))   # torch's pool, started
        gemv.gemv(x, w)
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_fits_only_few_float32_rows_without_a_gradient():
    w = torch.randn(64, 32)
    with torch.inference_mode():
        assert gemv.fits(torch.randn(gemv.MAX_ROWS, 32), w)
        assert not gemv.fits(torch.randn(gemv.MAX_ROWS + 1, 32), w)
        assert not gemv.fits(torch.randn(1, 32, dtype=torch.bfloat16), w.bfloat16())
        assert not gemv.fits(torch.randn(1, 32), torch.randn(32, 64).T)   # a transposed view
        assert not gemv.fits(torch.randn(1, 31), w)
        assert not gemv.fits(torch.randn(1, 1, 32), w)
    assert not gemv.fits(torch.randn(1, 32), w)   # grad mode: autograd would not see the product
    with torch.inference_mode(), pytest.raises(ValueError, match="does not apply"):
        gemv.gemv(torch.randn(1, 31), w)   # refused, not read past w's rows


def test_the_engines_linear_takes_the_kernel_for_decode_rows_and_onednn_for_a_prefill(monkeypatch):
    calls = []
    kernel = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    layer = Linear(576, 960, bias=False)
    with torch.inference_mode():
        x = torch.randn(1, 576)
        assert torch.equal(layer(x), kernel(x, layer.weight))
        big = torch.randn(gemv.MAX_ROWS + 1, 576)
        assert torch.allclose(layer(big), big @ layer.weight.T, rtol=0, atol=1e-5)
        with_bias = Linear(576, 960, bias=True)
        assert torch.allclose(with_bias(x), x @ with_bias.weight.T + with_bias.bias, rtol=0, atol=1e-5)
    assert calls == [1]   # the decode row only: not the prefill's 17 rows, nor a layer with a bias


def test_the_environment_turns_it_off():
    code = "import torch; from kvledger.engine.models import gemv; print(gemv.AVAILABLE)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVLEDGER_GEMV": "0"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


WIDTHS = [False, *([True] if gemv.WIDE or (gemv._gemv is not None and gemv._gemv.wide_available()) else [])]


@pytest.mark.parametrize("wide", WIDTHS, ids=lambda w: "16-lanes" if w else "8-lanes")
@pytest.mark.parametrize("n,k", [(2048, 640), (640, 2048), (49157, 64), (13, 37)])
def test_a_products_row_is_the_same_alone_and_in_any_batch(monkeypatch, wide, n, k):
    """`product`: each output row has the floats it has alone, in a batch of any size (the tiles of 4 × 3 and
    4 × 6, their remainders, the cache blocks), and on any thread count; within float32 rounding of float64."""
    monkeypatch.setattr(gemv, "WIDE", wide)
    x, w = _case(23, n, k, seed=2)
    with torch.inference_mode():
        alone = torch.cat([gemv.product(x[i:i + 1], w) for i in range(len(x))])
        for m in (2, 3, 5, 7, 16, 23):
            assert torch.equal(gemv.product(x[:m], w), alone[:m]), m
        ys = under_thread_counts(lambda: gemv.product(x, w), (1, 2, 3))
    assert all(torch.equal(y, alone) for y in ys)
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((alone.double() - x.double() @ w.double().T).abs() <= bound).all())
