"""A decoder layer's row-wise operators in kvledger's kernel (`_rowwise.c`), torch's operators where it does not
apply: Llama's and Gemma 3's RMSNorms with their residual adds, rotary embedding, and act(gate) · up.

torch runs a Llama layer's RMSNorm, residual add, rotary embedding and silu(gate) · up as about twelve operators,
each a pass over the whole [tokens × width] tensor. In a cold 2,304-token SmolLM2 prefill on the 2-core Xeon (AVX-512,
2 threads) they took 0.36 s of 3.02 (medians of 6, the forward timed with those operators made free, an upper
bound); the kernel reads each row once and takes one OpenMP region per operator. `scripts/rowwise_ab.py` measures
a forward both ways: 3.281 s with torch's operators, 2.701 s with the kernel (medians of 7). Gemma 3's cold
4,096-token prompt, `kvledger bench ttft --model gemma3-270m --threads 2` with `KVLEDGER_ROWWISE=0` and without,
interleaved: 7.29 and 7.46 s against 6.48 and 6.78 s (medians of 3; its hits stay bit-equal to its cold prefill).

Each function is the operator's torch formula, computed row by row in a fixed order: a row's result does not
depend on the others, on their number or on the thread count, so a prefill chunk's rows come out alike however the
prompt was cut. The rotation's bits are torch's; the RMSNorm's and the activations' agree with torch to float32
rounding (another order of summation, another exponential). `AVAILABLE` is false where the extension was not
built (it is optional), where the CPU lacks AVX2 or FMA, and where the environment says `KVLEDGER_ROWWISE=0`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:   # after torch, so the kernel joins torch's OpenMP runtime (libgomp.so.1) rather than loading another
    from kvledger.engine.models import _rowwise
except ImportError:
    _rowwise = None

AVAILABLE: bool = (_rowwise is not None and _rowwise.available()
                   and os.environ.get("KVLEDGER_ROWWISE", "1") != "0")


def _fits(*tensors: Tensor) -> bool:
    """The kernel applies: available, no gradient recorded, every tensor CPU float32."""
    return (AVAILABLE and not torch.is_grad_enabled()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, add: Tensor | None = None, into: Tensor | None = None
             ) -> Tensor:
    """y = x · rsqrt(mean(x²) + eps) · weight over the last dimension, x [rows, h] (HF Llama's RMSNorm; Gemma's
    with weight = 1 + w), returned. With `add`: x += add first, in place, and y is the norm of the sum (Llama's
    residual add before its norm). With `into`: into += y, in place, and `into` is returned (Gemma's residual add
    after its norm). One pass where torch takes two."""
    assert add is None or into is None, "the residual is added before the norm or after it, not both"
    for other, name in ((add, "add"), (into, "into")):
        if other is not None and other.shape != x.shape:
            raise ValueError(f"rms_norm: {name} {tuple(other.shape)} is not x's shape {tuple(x.shape)}")
    extra = tuple(t for t in (add, into) if t is not None)
    if not (_fits(x, weight, *extra) and x.dim() == 2 and x.is_contiguous() and weight.shape == (x.shape[1],)
            and weight.is_contiguous() and x.numel() > 0 and (into is None or into.is_contiguous())):
        if add is not None:
            x.add_(add)
        y = F.rms_norm(x, weight.shape, weight, eps)
        return y if into is None else into.add_(y)
    if add is not None:
        add = add.contiguous()
    out = torch.empty_like(x) if into is None else into
    _rowwise.rms_norm(x.data_ptr(), 0 if add is None else add.data_ptr(), weight.data_ptr(), out.data_ptr(),
                      x.shape[0], x.shape[1], eps, into is not None, torch.get_num_threads())
    return out


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding, halves layout (HF Llama), in torch: x [T, heads, d]; cos, signed_sin [T, 1, d] from
    `Llama._rope`. HF's x·cos + (−x₂, x₁)·sin, with the sign moved into the first half of `signed_sin`: x₂·(−s) is
    −(x₂·s) bit for bit, so this is HF's rotation with four operators where it took seven."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rotate_(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """`rotate(x, cos, signed_sin)` written into x and returned, bit for bit: x [T, heads, d] with contiguous heads
    (its rows may be further apart: a view of a wider matrix)."""
    t, heads, d = x.shape
    if not (_fits(x, cos, signed_sin) and x.stride(2) == 1 and x.stride(1) == d and x.stride(0) >= heads * d
            and d % 16 == 0 and t > 0 and cos.shape == signed_sin.shape == (t, 1, d)
            and cos.is_contiguous() and signed_sin.is_contiguous()):
        return x.copy_(rotate(x, cos, signed_sin))
    _rowwise.rotate(x.data_ptr(), x.stride(0), t, heads, d, cos.data_ptr(), signed_sin.data_ptr(),
                    torch.get_num_threads())
    return x


_SILU, _GELU_TANH = 0, 1   # _rowwise.c's act


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) · up, gate_up [rows, 2n] being gate and up side by side (Llama's stacked projection) → [rows, n]."""
    rows, width = gate_up.shape
    n = width // 2
    if not (_fits(gate_up) and gate_up.is_contiguous() and width % 16 == 0 and rows > 0):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = torch.empty(rows, n)
    up = gate_up.data_ptr() + n * gate_up.element_size()   # the second half of each row
    _rowwise.act_mul(_SILU, gate_up.data_ptr(), up, out.data_ptr(), rows, n, width, width, torch.get_num_threads())
    return out


def gelu_tanh_mul(gate: Tensor, up: Tensor) -> Tensor:
    """gelu(gate, approximate="tanh") · up, gate and up [rows, n] (Gemma 3's MLP) → [rows, n]."""
    if not (_fits(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.is_contiguous()
            and up.is_contiguous() and gate.shape[1] % 8 == 0 and gate.shape[0] > 0):
        return F.gelu(gate, approximate="tanh") * up
    rows, n = gate.shape
    out = torch.empty(rows, n)
    _rowwise.act_mul(_GELU_TANH, gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, n, n, n,
                     torch.get_num_threads())
    return out
