"""float32 matmuls for the reference engine's Llama (SmolLM2): a decode step's few rows in kvledger's own kernel
(`gemv.py`), the rest through oneDNN rather than MKL.

torch's CPU build does a float32 `F.linear` in MKL, and MKL takes its AVX2 kernels on AMD CPUs even where the
CPU has AVX-512 (`tests/engine/models/test_kernel_paths.py`). oneDNN, in the same build, picks its kernels by
the CPU's instruction set on either vendor. Measured on an AMD EPYC with AVX-512, 2 threads, float32:

    | product                                   | MKL      | oneDNN  |
    |-------------------------------------------|----------|---------|
    | a 2,304-token prefill's up projection     | 18.8 ms  | 8.5 ms  |
    |   [2304 × 576] · [576 × 1536]             |          |         |
    | one token's LM head [1 × 576] · [576 × 49152] | 6.9 ms | 2.9 ms |

with results within 1e-6 of MKL's, relative (another order of summation). `ONEDNN_MAX_CPU_ISA` caps oneDNN's
kernels as `MKL_ENABLE_INSTRUCTIONS` caps MKL's. Where torch has no oneDNN, or its operator is missing, the
forward is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvledger.engine.models import gemv


def _available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 1), torch.ones(1, 1), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


AVAILABLE = _available()


class Linear(nn.Linear):
    """`nn.Linear`, the same parameters and state dict, whose float32 forward of a 2-D input on the CPU runs in
    kvledger's kernel for a few rows without a bias (`gemv.fits`), and in oneDNN otherwise (module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None and gemv.fits(x, self.weight):
            return gemv.gemv(x, self.weight)
        if AVAILABLE and x.dim() == 2 and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
