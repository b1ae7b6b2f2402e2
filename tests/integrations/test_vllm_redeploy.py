"""New weights at the same path never read the old weights' KV (rule 11), under a real vLLM.

A vLLM with the connector stores a prompt computed by SmolLM2's weights (a copy in a temporary folder). Then new
weights are written at the same path (the same config, every layer's K and V projections scaled: a redeploy) and
a fresh vLLM with the connector on the same store asks the same prompt: it loads nothing (vLLM's cached tokens and
the connector's report say 0) and answers what a plain vLLM on the new weights answers, which differs from the old
weights' answer (so KV of the old weights would have shown). Asked again, the fresh engine hits what it stored
itself under the new weights' keys, with the same answer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess, wait_all
from kvledger.integrations.vllm.prompts import long_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")]

PROMPT_TOKENS = 300
HIT = (PROMPT_TOKENS - 1) // 128 * 128   # 256: the prompt's 2 whole blocks
MAX_TOKENS = 8
DTYPE = "float32"


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    """A copy of the SmolLM2 folder that the test may rewrite."""
    from kvledger.engine.models.registry import resolve

    return shutil.copytree(resolve("smollm2-135m").weights.folder(), tmp_path / "model")


def redeploy(folder: Path) -> None:
    """Write new weights over `folder`'s safetensors file, in place: the same tensors, names, shapes and config,
    every layer's K projection × 1.5 and V projection × 0.5 (so every layer's KV differs)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith("k_proj.weight"):
            tensors[name] = tensors[name] * 1.5
        elif name.endswith("v_proj.weight"):
            tensors[name] = tensors[name] * 0.5
    save_file(tensors, path, metadata={"format": "pt"})


def connector(model_dir: Path, store: Path, events: Path) -> VllmProcess:
    return VllmProcess({"model": str(model_dir), "connector": "kvledger", "store": str(store),
                        "events": str(events), "dtype": DTYPE})


def test_new_weights_at_the_same_path_load_nothing_of_the_old(tmp_path, model_dir):
    store, log = tmp_path / "store", tmp_path / "events.jsonl"
    prompt = long_prompt(PROMPT_TOKENS)
    with connector(model_dir, store, log) as old:
        before = old.generate(prompt, max_tokens=MAX_TOKENS)
    saved = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(e["ok"] for e in saved if e["event"] == "save") == PROMPT_TOKENS // 128   # the old KV is stored

    redeploy(model_dir)
    plain = VllmProcess({"model": str(model_dir), "connector": None, "dtype": DTYPE})
    fresh = connector(model_dir, store, log)
    wait_all([plain, fresh])
    try:
        reference = plain.generate(prompt, max_tokens=MAX_TOKENS)["tokens"]
        first = fresh.generate(prompt, max_tokens=MAX_TOKENS)
        again = fresh.generate(prompt, max_tokens=MAX_TOKENS)
    finally:
        plain.__exit__(None, None, None)
        fresh.__exit__(None, None, None)
    assert reference != before["tokens"]   # the new weights answer otherwise: old KV would change the answer
    assert first["num_cached_tokens"] == 0 and first["kv_transfer_params"]["kvledger"]["loaded_tokens"] == 0
    assert first["tokens"] == reference
    assert again["kv_transfer_params"]["kvledger"]["loaded_tokens"] == HIT and again["tokens"] == reference
