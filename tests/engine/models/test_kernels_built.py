"""The decode step's C kernels (`_gemv.c`, `_attend.c`) are optional extensions: an install where they fail to build
still works, on oneDNN and SDPA. So that a failed build cannot pass unseen here, where their tests would all skip:
on an x86-64 Linux CPU with AVX2 and FMA, both are built, importable and in use."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from kvledger.engine.models import attend, gemv


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file(), reason="x86-64 Linux only")
def test_both_kernels_are_built_where_the_cpu_has_avx2_and_fma():
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU lacks AVX2 or FMA: the engine runs oneDNN and SDPA")
    assert gemv._gemv is not None and attend._attend is not None, "an extension failed to build (setup.py)"
    assert gemv._gemv.available() and attend._attend.available()
