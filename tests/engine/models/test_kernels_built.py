"""The engine's C kernels (`_gemv.c`, `_attend.c`, `_rowwise.c`) are optional extensions: an install where they fail
to build still works, on oneDNN, SDPA and torch's operators. So that a failed build cannot pass unseen here, where
their tests would all skip: on an x86-64 Linux CPU with AVX2 and FMA, all three are built, importable and in use."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from kvledger.engine.models import attend, gemv, rowwise


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file(), reason="x86-64 Linux only")
def test_the_kernels_are_built_where_the_cpu_has_avx2_and_fma():
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU lacks AVX2 or FMA: the engine runs oneDNN, SDPA and torch's operators")
    modules = (gemv._gemv, attend._attend, rowwise._rowwise)
    assert all(m is not None for m in modules), "an extension failed to build (setup.py)"
    assert all(m.available() for m in modules)
