"""y = x · wᵀ in kvledger's own kernel (`_gemv.c`): a decode step's few rows, and any rows in a fixed order.

A decode step multiplies one row per sequence by every weight of the model, so its matmuls read all the
weights once a token and are bound by memory bandwidth. Measured on the 2-core AMD EPYC (AVX2), SmolLM2's 121
float32 weights (540 MB) with one row, 2 threads, three rounds (`scripts/decode_step_ab.py gemv` measures the
whole step):

    | all of one token's matmuls            | ms          |
    |---------------------------------------|-------------|
    | oneDNN (`_linear_pointwise`)           | 22.9–24.3   |
    | this kernel                            | 15.6–17.7   |
    | reading the same 540 MB (`Tensor.sum`) | 13.2–16.3   |

`gemv` is the engine's `Linear` (SmolLM2) for at most `MAX_ROWS` rows, where it is ahead of oneDNN, always in
eight lanes (few rows are bound by memory, not by lanes; SmolLM2's hit bound was measured with them). `product`
takes any number of rows: each output depends on its own row of x and row of w only, in an order of summation
fixed by k, so a model can put a whole batch (several decode steps and a prefill chunk) in one call, read the
weights once a step, and still compute each row as it would alone (Gemma 3). With many rows it runs in tiles
near the FMA units' peak: in eight lanes (AVX2) 80 GFLOP/s a core on the 2-core Xeon, in sixteen (AVX-512, where
the CPU has it: `WIDE`) 110–128 against MKL's 140–165 (Gemma 3's projections, 64 and 256 rows, one thread); see
models/gemma3.py for what that costs a prefill and gains a batch. The two widths sum in different fixed orders:
a machine's choice is made once a process, so its cold and hit computations agree; two CPU kinds round
differently, as their MKL kernels do.
Its results are within float32 rounding of oneDNN's (2e-7 to 4e-7 of the largest |y| against a float64 product,
oneDNN's 2e-7 to 1e-6).

`AVAILABLE` is false where the extension was not built (it is optional), where the CPU lacks AVX2 or FMA, and
where the environment says `KVLEDGER_GEMV=0`; the caller keeps its own path then. `KVLEDGER_GEMV_WIDE=0` keeps
eight lanes on an AVX-512 CPU (the tests' AVX2 path).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:   # after torch, so the kernel joins torch's OpenMP runtime (libgomp.so.1) rather than loading another
    from kvledger.engine.models import _gemv
except ImportError:
    _gemv = None

MAX_ROWS = 16
AVAILABLE: bool = _gemv is not None and _gemv.available() and os.environ.get("KVLEDGER_GEMV", "1") != "0"
# sixteen lanes where the CPU has AVX-512F (another fixed order: other bits than eight lanes), chosen once a process
WIDE: bool = AVAILABLE and _gemv.wide_available() and os.environ.get("KVLEDGER_GEMV_WIDE", "1") != "0"


def fits(x: Tensor, w: Tensor) -> bool:
    """Whether `gemv(x, w)` applies: the kernel is available, x is a CPU float32 matrix of at most MAX_ROWS rows
    whose width is w's, w is contiguous float32, and nothing records a gradient."""
    return (AVAILABLE and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu" and w.is_contiguous()
            and x.shape[1] == w.shape[1] and not torch.is_grad_enabled())


def product(x: Tensor, w: Tensor) -> Tensor:
    """x · wᵀ for any number of rows, x [m × k] and w [n × k] float32 (w's rows contiguous, any distance apart)
    → [m × n]: each y[i][j] depends on row i of x and row j of w only, never on m, the other rows or the thread
    count (`_gemv.c`), so a model can put every row of a batch (decode steps and prefill chunks alike) in one call
    and read w once. The kernel must be available (`AVAILABLE`); ValueError where the shapes or dtypes do not
    apply."""
    if not (AVAILABLE and x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu" and x.shape[1] == w.shape[1] and w.stride(1) == 1
            and w.stride(0) >= w.shape[1] and w.shape[0] and w.shape[1]):
        raise ValueError(f"the kernel does not apply to x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} "
                         f"{w.dtype} (strides {w.stride()})")
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    if x.shape[0]:
        _gemv.gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], w.shape[1],
                   torch.get_num_threads(), WIDE, w.stride(0))
    return y


def gemv(x: Tensor, w: Tensor) -> Tensor:
    """x · wᵀ, x [m × k] and w [n × k] float32 → [m × n], on torch's threads (`fits` must hold; ValueError
    otherwise)."""
    if not fits(x, w):   # not an assert: the kernel reads raw pointers, so this check is what keeps it in bounds
        raise ValueError(f"gemv does not apply to x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    _gemv.gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], w.shape[1],
               torch.get_num_threads(), False, w.shape[1])
    return y
