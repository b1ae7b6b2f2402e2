"""The bit-exactness tests again, each under another of MKL's GEMM kernel paths.

torch's CPU build does float32 matmuls in MKL, and MKL picks its kernels by CPU (AVX2, AVX-512,
AMX) and by matrix shape. A kernel choice is made at MKL's start, so each path needs a process of
its own. `MKL_ENABLE_INSTRUCTIONS` caps the instruction set on Intel CPUs; on AMD ones MKL takes
its AVX2 path whatever it says, so `MKL_CBWR=COMPATIBLE` (MKL's SSE2 reference kernels, which
round differently from the fast ones) is the path that differs on every machine. The two claims checked, on the
same machine:

- tiny-v4 is bit-exact: a resume, any chunking and a decode step give `torch.equal` logits to
  the cold prefill, whichever kernels the machine's MKL picks (tiny_v4_attention.py says how);
  checked under every path.
- Gemma 3 270M is bit-exact the same way: a chunked prefill, a snapshot hit, a checkpoint resume and a next
  turn give `torch.equal` logits to the cold prefill; checked under the AVX2 and AVX-512 paths (its products in
  kvledger's fixed-order kernel, `gemv.product`, in eight lanes on the AVX2 path, `KVLEDGER_GEMV_WIDE=0`; its
  attention in MKL). Under the one that differs everywhere,
  with that kernel off too (`KVLEDGER_GEMV=0`: every product in fixed-row GEMMs, `fixed_rows`, as on a CPU
  without AVX2), whose SSE2 kernels run Gemma about 2.5 times slower, the chunked prefill and the snapshot hit
  are checked (30 s): the checkpoint resume and the next turn are the
  same fixed-row GEMMs at other positions, and would add 90 s. (Its comparisons with transformers, bounded
  by 1e-3, are left out: their reference was computed with the default kernels.)
- SmolLM2 on the reference engine is exact within float32 rounding: a hit computes its last rows
  in GEMMs of another row count than the cold prefill, which may round differently, so its
  logits are bounded (max |Δ| ≤ 1e-4 · max |logit|) and its 32 greedy tokens must be equal;
  checked under the path that differs here too, on its three hits that compare with the cold answer
  (the ledger's, the whole-prompt one and the handed tail's; its fault tests run no other GEMMs). Its
  matmuls run in oneDNN (`models/onednn.py`), not MKL, so that case also caps oneDNN at SSE4.1
  (`ONEDNN_MAX_CPU_ISA`), which is another kernel path on every x86-64 CPU the suite runs on, and turns off
  kvledger's AVX2 kernels of its decode step (`KVLEDGER_GEMV=0`, `KVLEDGER_ATTEND=0`), as a CPU without AVX2
  would, and its AVX-512 kernel of a prompt's attention (`KVLEDGER_PROMPT_ATTEND=0`), as a CPU without AVX-512
  would.

`MKL_ENABLE_INSTRUCTIONS` can only lower MKL's instruction set, and only on Intel CPUs: on a CPU without
AVX-512, or on an AMD one (checked on an AMD EPYC with AVX-512: GEMMs of the engine's shapes gave the
same bits capped at AVX, AVX2, AVX-512 or not at all, and other bits under `MKL_CBWR=COMPATIBLE`),
capping it leaves MKL on the very path the suite itself runs these tests on, so those cases are skipped
there, saying so (2.5 to 3 minutes of duplicate model runs on a 2-core machine). One thread is not a case of
its own for the same reason: the suite runs every model test on one torch thread (tests/conftest.py, and the
tiny-v4 fixture), so a one-thread rerun was the suite's own path again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIT_EXACT = [f"tests/engine/models/{name}" for name in (
    "test_tiny_v4_exact.py", "test_tiny_v4_engine_path.py", "test_tiny_v4_replay.py", "test_tiny_v4_yoco.py")]
WITHIN_ROUNDING = ["tests/engine/test_smollm2.py", "-k", "full_hit_matches_cold or every_block or hands_its_tail"]
GEMMA_BIT_EXACT = ["tests/engine/models/test_gemma3.py", "-k", "chunked or snapshot_hit or checkpoint or decode_window"]
GEMMA_BIT_EXACT_SLOW_KERNELS = ["tests/engine/models/test_gemma3.py", "-k", "chunked or snapshot_hit"]
KERNEL_PATHS = {
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "KVLEDGER_GEMV_WIDE": "0"},   # kvledger's kernel too
    "mkl-avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    # and Gemma 3's products in fixed-row GEMMs (what a CPU without AVX2 computes), in MKL's reference kernels
    "compatible-no-gemv": {"MKL_CBWR": "COMPATIBLE", "KVLEDGER_GEMV": "0"},
    # MKL's and oneDNN's reference paths, and no kernel of kvledger's own (`gemv.py`, `attend.py`, `prompt_attend.py`)
    "compatible-sse41": {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41", "KVLEDGER_GEMV": "0",
                         "KVLEDGER_ATTEND": "0", "KVLEDGER_PROMPT_ATTEND": "0"},
}


CASES = [*((path, BIT_EXACT) for path in ("mkl-avx2", "mkl-avx512", "mkl-compatible")),
         ("compatible-sse41", WITHIN_ROUNDING),
         *((path, GEMMA_BIT_EXACT) for path in ("mkl-avx2", "mkl-avx512")),
         ("compatible-no-gemv", GEMMA_BIT_EXACT_SLOW_KERNELS)]
NAMES = {id(BIT_EXACT): "bit", id(WITHIN_ROUNDING): "rounding", id(GEMMA_BIT_EXACT): "gemma3-bit",
         id(GEMMA_BIT_EXACT_SLOW_KERNELS): "gemma3-bit"}


@pytest.mark.parametrize(("path", "tests"), CASES, ids=[f"{p}-{NAMES[id(t)]}" for p, t in CASES])
def test_exactness_holds_under_kernel_path(path: str, tests: list[str]) -> None:
    cap = KERNEL_PATHS[path].get("MKL_ENABLE_INSTRUCTIONS")
    if cap is not None and not (_cpu_info("vendor_id") == ["GenuineIntel"] and "avx512f" in _cpu_info("flags")):
        pytest.skip(f"MKL_ENABLE_INSTRUCTIONS moves MKL's kernels only on an Intel CPU with AVX-512: on this one, "
                    f"capped at {cap}, MKL stays on the path the suite itself runs these tests on")
    env = {**os.environ, **KERNEL_PATHS[path]}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"under {KERNEL_PATHS[path]}:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"


def _cpu_info(field: str) -> list[str]:
    """The words of /proc/cpuinfo's first `field` line (none where there is no such file or line)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.split()
    return []
