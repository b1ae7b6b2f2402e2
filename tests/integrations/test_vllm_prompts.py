"""The long prompts of the vLLM tests and bench come from package data, never from the README: a README edit
changed them, and outside a checkout they failed (issue 55)."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

from kvledger.integrations.vllm import prompts

ROOT = Path(__file__).resolve().parents[2]


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def test_the_document_ships_in_the_package():
    package = Path(prompts.__file__).parent
    assert prompts.DOCUMENT.is_file() and prompts.DOCUMENT.parent == package / "data"
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/*" in package_data["kvledger.integrations.vllm"]


def test_the_prompts_keep_their_token_ids():
    """The ids `long_prompt` gave when it read the README of 7e26b3b, which the document is a copy of."""
    assert _digest(prompts.long_prompt(4096)) == "5fb9f74904242196"
    assert _digest(prompts.long_prompt(4096, 1, model="gemma3-270m", bos=2)) == "7017b7a59ae06342"
