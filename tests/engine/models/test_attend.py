"""kvledger's kernel for one query's attention (`models/attend.py`, `_attend.c`): SDPA's result to float32
rounding over any length (within a tile, across tiles and spans), any head layout the mirror hands it, the same bits
for any thread count, and used by the engine's decode step only where it applies."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvledger.engine.models import attend
from tests.engine.models.thread_counts import under_thread_counts

pytestmark = pytest.mark.skipif(not attend.AVAILABLE, reason="the kernel is not built, or this CPU lacks AVX2/FMA")

# (kv_heads, group, end, d): SmolLM2's at its decode lengths; one position; a tile's tail; past one span (512)
# and several; other groups and head sizes (the first row of four past the group, d not 64)
SHAPES = [(3, 3, 2304, 64), (3, 3, 1, 64), (3, 3, 7, 64), (3, 3, 64, 64), (3, 3, 513, 64), (3, 3, 1537, 64),
          (2, 5, 1000, 128), (1, 1, 71, 8), (4, 8, 700, 64), (1, 16, 300, 256)]


def _case(h: int, group: int, end: int, d: int, seed: int = 0, spread: float = 2.0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, and k, v as the decode mirror hands them: views of a longer buffer, rows contiguous, heads apart."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, h, end + 37, d, generator=g) * spread
    return torch.randn(h, group, d, generator=g), kv[0, :, :end], kv[1, :, :end]


def _float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q.double() @ k.double().transpose(1, 2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, -1) @ v.double()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_result_is_sdpas_to_float32_rounding(shape):
    q, k, v = _case(*shape)
    with torch.inference_mode():
        out = attend.attend(q, k, v)
        sdpa = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))[0]
    want = _float64(q, k, v)
    scale = float(want.abs().max())
    err, sdpa_err = float((out.double() - want).abs().max()) / scale, float((sdpa.double() - want).abs().max()) / scale
    assert out.shape == q.shape
    assert err <= 1e-5 and err <= 4 * sdpa_err + 1e-6, (err, sdpa_err)


def test_a_peaked_softmax_and_a_flat_one():
    """Scores far apart (one position takes all the weight, the others' exponentials underflow) and all equal."""
    q, k, v = _case(3, 3, 900, 64, seed=3, spread=40.0)
    with torch.inference_mode():
        out = attend.attend(q, k, v)
    want = _float64(q, k, v)
    assert float((out.double() - want).abs().max() / want.abs().max()) <= 1e-5
    q = torch.zeros(3, 3, 64)
    _, k, v = _case(3, 3, 900, 64, seed=4)
    with torch.inference_mode():
        out = attend.attend(q, k, v)
    assert torch.allclose(out, v.mean(1, keepdim=True).expand_as(out), rtol=0, atol=1e-5)


def test_the_bits_are_the_same_for_any_thread_count():
    q, k, v = _case(3, 3, 2304, 64, seed=1)
    outs = under_thread_counts(lambda: attend.attend(q, k, v), (1, 2, 3, 5))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_fits_only_what_the_kernel_reads():
    q, k, v = _case(3, 3, 100, 64)
    with torch.inference_mode():
        assert attend.fits(q, k, v)
        assert not attend.fits(q.transpose(0, 1).contiguous().transpose(0, 1), k, v)   # q not contiguous
        assert not attend.fits(q, k.transpose(1, 2).contiguous().transpose(1, 2), v)   # k's rows strided
        assert not attend.fits(q, k.bfloat16(), v)
        assert not attend.fits(q[..., :60].contiguous(), k[..., :60].contiguous(), v[..., :60].contiguous())
        assert not attend.fits(torch.randn(3, 17, 64), k, v)   # more query rows per KV head than MAX_GROUP
        assert not attend.fits(q, k[:, :50], v)
    assert not attend.fits(q, k, v)   # grad mode
    with torch.inference_mode(), pytest.raises(ValueError, match="does not apply"):
        attend.attend(q, k[:, :50], v)   # refused, not read past k's end


def test_a_decode_step_takes_the_kernel_and_matches_sdpa(monkeypatch):
    """The engine's `_attend_one`: the kernel where it applies, with SDPA's result to rounding."""
    from kvledger.engine.models import llama
    from kvledger.engine.models.base import Chunk, PagedKV

    cfg = llama.LlamaConfig(hidden=96, intermediate=64, layers=1, heads=6, kv_heads=2, vocab=64, rope_theta=1e4,
                            rms_eps=1e-5, max_positions=512, tie_embeddings=True, eos_token_ids=(2,))   # head_dim 16
    layer = llama.Attention(cfg)
    cache = PagedKV(16, 2, 16, torch.float32, llama.MIRROR_SHARE)
    cache.allocate(16, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    table = torch.arange(1, 16)
    k, v = torch.randn(200, 2, 16, generator=g), torch.randn(200, 2, 16, generator=g)
    cache.write(table, 0, k, v)
    q = torch.randn(1, 6, 16, generator=g)
    calls = []
    kernel = attend.attend
    monkeypatch.setattr(attend, "attend", lambda *a: calls.append(1) or kernel(*a))
    with torch.inference_mode():
        got = layer._attend_one(q, Chunk(torch.zeros(1, dtype=torch.long), 199, table), cache)
        monkeypatch.setattr(attend, "AVAILABLE", False)
        sdpa = layer._attend_one(q, Chunk(torch.zeros(1, dtype=torch.long), 199, table), cache)
    assert calls == [1]
    assert torch.allclose(got, sdpa, rtol=0, atol=1e-5)


def test_the_environment_turns_it_off():
    code = "import torch; from kvledger.engine.models import attend; print(attend.AVAILABLE)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVLEDGER_ATTEND": "0"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
