"""The reference Llama's operators against Hugging Face's formulas, bit for bit where the claim is exact."""

import torch

from kvledger.engine.models.llama import RMSNorm, rotate


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's `apply_rotary_pos_emb`: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_rotate_with_the_sign_in_sin_is_hf_rotation_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(300, 12, 64) * 30
    freqs = torch.arange(300).float().unsqueeze(1) * torch.rand(32).unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    signed = emb.sin()
    signed[..., :32].neg_()
    assert torch.equal(rotate(x, emb.cos(), signed), hf_rotate(x, emb.cos(), emb.sin()))


def test_rms_norm_is_hf_formula_within_float32_rounding():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576)
    x = torch.randn(300, 576) * 5
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    got = norm(x)
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
