"""One query's attention over its sequence's K and V, in kvledger's own kernel (`_attend.c`): a decode step's.

torch's `scaled_dot_product_attention` on the CPU runs its flash kernel, made for blocks of many queries; with one
query per head it took about 11 ms of a SmolLM2 decode step at 2,304 tokens (30 layers, 106 MB of float32 K and V,
2 threads), where reading those bytes takes about 3. This kernel reads each K and V row once for all the query
heads that share it, in spans of a fixed length spread over torch's OpenMP threads (`_attend.c` says how).
Measured in `scripts/decode_step_ab.py attend`.

Its result is within float32 rounding of SDPA's (another order of summation and another exponential), the same
bits for any thread count. `AVAILABLE` is false where the extension was not built (it is optional), where the
CPU lacks AVX2 or FMA, and where the environment says `KVLEDGER_ATTEND=0`; the caller keeps SDPA then.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

try:   # after torch, so the kernel joins torch's OpenMP runtime (libgomp.so.1) rather than loading another
    from kvledger.engine.models import _attend
except ImportError:
    _attend = None

AVAILABLE: bool = _attend is not None and _attend.available() and os.environ.get("KVLEDGER_ATTEND", "1") != "0"
MAX_GROUP, MAX_D = 16, 256   # _attend.c's bounds


def fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `attend(q, k, v)` applies: the kernel is available; q is [kv_heads, group, d] contiguous, k and v
    [kv_heads, end, d] with contiguous rows; all CPU float32; d a multiple of 8 up to MAX_D, group up to
    MAX_GROUP; nothing records a gradient."""
    if not AVAILABLE or q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or torch.is_grad_enabled():
        return False
    h, group, d = q.shape
    return (k.shape == v.shape and k.shape[0] == h and k.shape[2] == d and k.shape[1] >= 1
            and group <= MAX_GROUP and d % 8 == 0 and d <= MAX_D
            and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == k.device.type == v.device.type == "cpu" and q.is_contiguous()
            and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == d)


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q · kᵀ / √d) · v per KV head, q [kv_heads, group, d], k and v [kv_heads, end, d] → [kv_heads,
    group, d]: what `scaled_dot_product_attention` gives for these shapes without a mask (`fits` must hold;
    ValueError otherwise)."""
    if not fits(q, k, v):   # not an assert: the kernel reads raw pointers, so this check is what keeps it in bounds
        raise ValueError(f"attend does not apply to q {tuple(q.shape)}, k {tuple(k.shape)} {k.stride()}, "
                         f"v {tuple(v.shape)} {v.stride()}, {q.dtype}")
    out = torch.empty_like(q)
    h, group, d = q.shape
    _attend.attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), h, group, k.shape[1], d,
                   k.stride(0), v.stride(0), 1.0 / math.sqrt(d), torch.get_num_threads())
    return out
