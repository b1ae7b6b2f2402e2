import subprocess
import sys
from pathlib import Path

import pytest

KVLEDGER = Path(sys.executable).parent / "kvledger"


@pytest.fixture
def run_cli():
    """Run the installed `kvledger` console script; returns the CompletedProcess (text)."""

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(KVLEDGER), *args], capture_output=True, text=True, timeout=timeout)

    return run
