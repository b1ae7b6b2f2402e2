"""kvledger's kernel for a decoder layer's row-wise operators (`models/rowwise.py`, `_rowwise.c`): torch's formulas
(the rotation bit for bit, the RMSNorm, silu · up and tanh-GELU · up to float32 rounding), each row alike whatever
rows surround it and whatever the thread count, torch's own operators wherever the kernel does not apply, and the
engine's Llama layer taking it (Gemma 3's: `test_gemma3.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvledger.engine.models import rowwise
from tests.engine.models.thread_counts import under_thread_counts

pytestmark = pytest.mark.skipif(not rowwise.AVAILABLE, reason="the kernel is not built, or this CPU lacks AVX2/FMA")


def _randn(*shape: int, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * spread


def _rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _cos_sin(t: int, d: int, theta: float = 1e4) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [t, 1, d] of positions 0..t − 1, as `Llama._rope` makes them."""
    freqs = torch.arange(t).float().unsqueeze(1) * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat((freqs, freqs), -1).unsqueeze(1)
    sin = emb.sin()
    sin[..., :d // 2].neg_()
    return emb.cos(), sin


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("rows,h", [(2304, 576), (1, 576), (3, 13), (40, 2048)])
def test_rms_norm_is_the_formula_to_float32_rounding(rows, h):
    x, w = _randn(rows, h), _randn(h, seed=1, spread=1.0)
    with torch.inference_mode():
        got = rowwise.rms_norm(x, w, 1e-5)
        torch_err = _rel(F.rms_norm(x, (h,), w, 1e-5), _rms_norm64(x, w, 1e-5))
    err = _rel(got, _rms_norm64(x, w, 1e-5))
    assert got.shape == x.shape and err <= 1e-6 and err <= 4 * torch_err + 2e-7, (err, torch_err)


def test_rms_norm_with_add_updates_the_residual_in_place_then_norms_the_sum():
    x, add, w = _randn(300, 576), _randn(300, 576, seed=2), _randn(576, seed=3, spread=1.0)
    want_sum = x + add
    with torch.inference_mode():
        got = rowwise.rms_norm(x, w, 1e-6, add=add)
    assert torch.equal(x, want_sum)   # the same bits as torch's add
    assert _rel(got, _rms_norm64(want_sum, w, 1e-6)) <= 1e-6
    with torch.inference_mode(), pytest.raises(ValueError, match="not x's shape"):
        rowwise.rms_norm(x, w, 1e-6, add=add[:10])


def test_rms_norm_into_adds_the_norm_to_the_residual_in_place():
    """Gemma 3's order: residual + norm(x), the norm rounded before the add, as torch's two operators round."""
    x, residual, w = _randn(300, 640), _randn(300, 640, seed=2), _randn(640, seed=3, spread=1.0)
    before = residual.clone()
    with torch.inference_mode():
        norm = rowwise.rms_norm(x, w, 1e-6)
        got = rowwise.rms_norm(x, w, 1e-6, into=residual)
    assert got.data_ptr() == residual.data_ptr() and torch.equal(got, before + norm)
    with torch.inference_mode(), pytest.raises(ValueError, match="not x's shape"):
        rowwise.rms_norm(x, w, 1e-6, into=residual[:10])


def test_rotation_is_torchs_bit_for_bit_on_a_view_of_wider_rows():
    """Q and K heads inside the stacked QKV output, as `Attention.qkv` rotates them: only those columns change."""
    t, heads, d = 517, 12, 64
    qkv = _randn(t, 15 * d)
    cos, sin = _cos_sin(t, d)
    view = qkv[:, :heads * d].view(t, heads, d)
    want, rest = rowwise.rotate(view, cos, sin), qkv[:, heads * d:].clone()
    with torch.inference_mode():
        got = rowwise.rotate_(view, cos, sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, want) and torch.equal(qkv[:, heads * d:], rest)


@pytest.mark.parametrize("rows,n", [(2304, 1536), (1, 1536), (5, 8)])
def test_silu_mul_is_torchs_to_float32_rounding(rows, n):
    gu = _randn(rows, 2 * n, spread=4.0)
    want = F.silu(gu[:, :n].double()) * gu[:, n:].double()
    with torch.inference_mode():
        got = rowwise.silu_mul(gu)
        torch_err = _rel(F.silu(gu[:, :n]) * gu[:, n:], want)
    err = _rel(got, want)
    assert got.shape == (rows, n) and err <= 1e-6 and err <= 4 * torch_err + 2e-7, (err, torch_err)


@pytest.mark.parametrize("rows,n", [(4096, 2048), (1, 2048), (3, 8)])
def test_gelu_tanh_mul_is_torchs_to_float32_rounding(rows, n):
    gate, up = _randn(rows, n, spread=4.0), _randn(rows, n, seed=1)
    want = F.gelu(gate.double(), approximate="tanh") * up.double()
    with torch.inference_mode():
        got = rowwise.gelu_tanh_mul(gate, up)
        torch_err = _rel(F.gelu(gate, approximate="tanh") * up, want)
    err = _rel(got, want)
    assert got.shape == (rows, n) and err <= 1e-6 and err <= 4 * torch_err + 2e-7, (err, torch_err)


def test_silu_mul_at_the_ends_of_the_float_range():
    g = torch.tensor([-1e30, -200.0, -88.5, -88.0, -87.5, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.5, 88.5, 200.0, 1e30,
                      3.0, -3.0])
    gu = torch.cat((g, torch.ones(16))).unsqueeze(0)
    with torch.inference_mode():
        got = rowwise.silu_mul(gu)[0]
    want = F.silu(g.double())
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-30), (got, want)
    with torch.inference_mode():
        got = rowwise.gelu_tanh_mul(g.unsqueeze(0), torch.ones(1, 16))[0]
    want = F.gelu(g.double(), approximate="tanh")
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-30), (got, want)


def test_each_row_is_the_same_alone_or_among_others_and_for_any_thread_count():
    """What makes a prefill chunk's rows equal to a one-forward prefill's: no row depends on the rest."""
    x, w = _randn(2304, 576), _randn(576, seed=1)
    gu = _randn(2304, 3072, seed=2)
    norms = under_thread_counts(lambda: rowwise.rms_norm(x.clone(), w, 1e-5), (1, 2, 3))
    mlps = under_thread_counts(lambda: rowwise.silu_mul(gu), (1, 2, 3))
    gelus = under_thread_counts(lambda: rowwise.gelu_tanh_mul(gu[:, :1536].contiguous(), gu[:, 1536:].contiguous()),
                                (1, 2, 3))
    assert all(torch.equal(gelus[0], o) for o in gelus[1:])
    assert all(torch.equal(norms[0], o) for o in norms[1:]) and all(torch.equal(mlps[0], o) for o in mlps[1:])
    with torch.inference_mode():
        assert torch.equal(rowwise.rms_norm(x[1000:1001].clone(), w, 1e-5), norms[0][1000:1001])
        assert torch.equal(rowwise.silu_mul(gu[7:263].contiguous()), mlps[0][7:263])


def test_what_the_kernel_does_not_take_is_torchs(monkeypatch):
    """A strided or float64 input, or grad mode, runs torch's operators with torch's result."""
    calls = []
    for name in ("rms_norm", "rotate", "act_mul"):
        kernel = getattr(rowwise._rowwise, name)
        monkeypatch.setattr(rowwise._rowwise, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    x, w = _randn(64, 576).t(), _randn(64)          # rows not contiguous
    gu = _randn(16, 3072).double()                  # float64
    gate, up = _randn(16, 3072).chunk(2, dim=1)    # views whose rows are not contiguous
    with torch.inference_mode():
        assert torch.equal(rowwise.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))
        assert torch.equal(rowwise.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:])
        assert torch.equal(rowwise.gelu_tanh_mul(gate, up), F.gelu(gate, approximate="tanh") * up)
    gu = _randn(16, 3072)
    assert torch.equal(rowwise.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:])   # grad mode
    assert calls == []
    with torch.inference_mode():
        rowwise.silu_mul(gu)
    assert calls == ["act_mul"]


def test_the_llama_layer_takes_the_kernel_and_matches_torchs_operators(monkeypatch):
    """One SmolLM2-shaped layer over a prompt, the kernel against torch's operators (`AVAILABLE` off): outputs and
    the K, V it wrote agree to float32 rounding, and every operator went through the kernel."""
    from kvledger.engine.models import llama
    from kvledger.engine.models.base import Chunk, PagedKV

    cfg = llama.LlamaConfig(hidden=576, intermediate=1536, layers=1, heads=9, kv_heads=3, vocab=64, rope_theta=1e5,
                            rms_eps=1e-5, max_positions=4096, tie_embeddings=True, eos_token_ids=(2,))
    torch.manual_seed(0)
    layer = llama.DecoderLayer(cfg)
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    cos, sin = _cos_sin(300, 64, 1e5)
    table, x = torch.arange(1, 5), _randn(300, 576, spread=1.0)
    outs, kv, calls = {}, {}, []
    for name in ("rms_norm", "rotate", "act_mul"):
        kernel = getattr(rowwise._rowwise, name)
        monkeypatch.setattr(rowwise._rowwise, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    for on in (True, False):
        monkeypatch.setattr(rowwise, "AVAILABLE", on)
        cache = PagedKV(128, 3, 64, torch.bfloat16, llama.MIRROR_SHARE)
        cache.allocate(6, 0, torch.device("cpu"))
        with torch.inference_mode():
            outs[on] = layer(x.clone(), cos, sin, [Chunk(torch.zeros(300, dtype=torch.long), 0, table)], cache)
            kv[on] = cache.gather(table, 300, torch.float32)
    assert sorted(set(calls)) == ["act_mul", "rms_norm", "rotate"] and calls.count("rms_norm") == 2
    assert _rel(outs[True], outs[False]) <= 1e-5
    assert all(_rel(kv[True][i], kv[False][i]) <= 1e-2 for i in (0, 1))   # K and V, rounded to bf16


def test_the_environment_turns_it_off():
    code = "import torch; from kvledger.engine.models import rowwise; print(rowwise.AVAILABLE)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVLEDGER_ROWWISE": "0"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
