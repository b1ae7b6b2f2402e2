"""float32 matmuls for the reference engine's Llama (SmolLM2): a decode step's few rows in kvledger's own kernel
(`gemv.py`), the rest in MKL on an Intel CPU with AVX-512 and in oneDNN elsewhere (`MKL_ROWS`).

torch's CPU build does a float32 `F.linear` in MKL, and MKL takes its AVX2 kernels on AMD CPUs even where the
CPU has AVX-512 (`tests/engine/models/test_kernel_paths.py`). oneDNN, in the same build, picks its kernels by
the CPU's instruction set on either vendor. Measured on an AMD EPYC with AVX-512, 2 threads, float32:

    | product                                   | MKL      | oneDNN  |
    |-------------------------------------------|----------|---------|
    | a 2,304-token prefill's up projection     | 18.8 ms  | 8.5 ms  |
    |   [2304 × 576] · [576 × 1536]             |          |         |
    | one token's LM head [1 × 576] · [576 × 49152] | 6.9 ms | 2.9 ms |

with results within 1e-6 of MKL's, relative (another order of summation). On an Intel Xeon (AVX-512, AMX) MKL
is the faster: a 2,304-row prefill's four products take 42.9 ms a layer against 47.2 in oneDNN (the up
projection 21.6 against 24.0), and a SmolLM2 cold forward of 2,304 tokens 2.12 s against 2.27 (medians of 5,
interleaved); 256 rows gain nothing measurable. A row's floats may depend on how many rows share its product
(MKL's do at two threads: 3 rows, 64 and 129 of the down projection round otherwise than among 4,096), so a hit's
rows are the cold prefill's within float32 rounding, never claimed bit for bit (`tests/engine/models/test_llama.py`
bounds them). `KVLEDGER_MATMUL=onednn` keeps oneDNN on an Intel CPU too.
`ONEDNN_MAX_CPU_ISA` caps oneDNN's kernels as `MKL_ENABLE_INSTRUCTIONS` caps MKL's. Where torch has no oneDNN,
or its operator is missing, the forward is `F.linear`.
"""

from __future__ import annotations

import os

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


def _mkl_avx512() -> bool:
    """Whether MKL runs its AVX-512 GEMM here: an Intel CPU with AVX-512F (Linux's /proc/cpuinfo; False where it
    cannot be read), MKL neither capped below AVX-512 (`MKL_ENABLE_INSTRUCTIONS`) nor on its reference kernels
    (`MKL_CBWR`). Its AVX2 kernels round a prompt's rows further from the few-rows GEMV's (a 2-token SmolLM2 hit
    4.1e-4 of max |logit| from cold, against 1.2e-4 with oneDNN), so they are not taken."""
    cap = (os.environ.get("MKL_ENABLE_INSTRUCTIONS") or "AVX512").upper()
    if not cap.startswith(("AVX512", "AVX10")) or os.environ.get("MKL_CBWR"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return False
    return "GenuineIntel" in info and " avx512f" in info


AVAILABLE = _available()
# a prompt's many rows in MKL rather than oneDNN (module docstring); never the rows of a forward with `steps`
MKL_ROWS: bool = _mkl_avx512() and os.environ.get("KVLEDGER_MATMUL", "") != "onednn"


class Linear(nn.Linear):
    """`nn.Linear`, the same parameters and state dict, whose float32 forward of a 2-D input on the CPU runs in
    kvledger's kernel for a few rows without a bias (`gemv.fits`: a decode step's), and in MKL or oneDNN otherwise
    (`MKL_ROWS`)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None and gemv.fits(x, self.weight):
            return gemv.gemv(x, self.weight)
        if not (AVAILABLE and x.dim() == 2 and x.device.type == "cpu"
                and x.dtype == self.weight.dtype == torch.float32):
            return F.linear(x, self.weight, self.bias)
        if MKL_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
