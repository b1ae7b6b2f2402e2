"""Rule 4″ under vLLM (Gemma 3 through the connector, float32): a prefix that conversations share but none ends at
gets its window where the second conversation finds the blocks and no window, so a third, in a fresh vLLM process,
resumes there. Three prompts share 5 blocks (640 tokens) and go on differently to ~1,040 tokens (each one's own
snapshot: at 1,024, which no other shares). vLLM A serves the first (blocks and the window at 1,024 saved); a fresh
vLLM B serves the second: 5 blocks present, no window in reach → a miss that saves the window at the branch point
640 too; a fresh vLLM C serves the third: 640 tokens loaded (the blocks and that window), the plain vLLM's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess, wait_all
from kvledger.integrations.vllm.prompts import long_prompt

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")

SHARED = 5 * 128
MAX_TOKENS = 8


def opts(model_dir: Path, store: Path | None, events: Path | None) -> dict:
    base = {"model": str(model_dir), "dtype": "float32", "max_model_len": 4096}
    if store is None:
        return base | {"connector": None, "prefix_caching": True}
    return base | {"connector": "kvledger", "store": str(store), "events": str(events), "model_name": "gemma3-270m"}


def window_saves(path: Path, since: int) -> list[int]:
    lines = [json.loads(line) for line in path.read_text().splitlines()][since:]
    return sorted(e["position"] for e in lines if e["event"] == "window_save" and e["ok"])


@pytest.mark.vllm
@needs_vllm
def test_a_fresh_vllm_resumes_a_third_conversation_at_the_branch_point(tmp_path):
    from kvledger.engine.models.registry import resolve

    model_dir = resolve("gemma3-270m").weights.folder()
    store, log = tmp_path / "store", tmp_path / "events.jsonl"
    shared = long_prompt(SHARED, model="gemma3-270m", bos=2)
    prompts = [shared + long_prompt(400, variant=i + 1, model="gemma3-270m") for i in range(3)]
    assert all(p[:SHARED] == shared and p[SHARED:SHARED + 8] != prompts[0][SHARED:SHARED + 8] for p in prompts[1:])
    plain, first = VllmProcess(opts(model_dir, None, None)), VllmProcess(opts(model_dir, store, log))
    wait_all([plain, first])
    try:
        reference = plain.generate(prompts[2], max_tokens=MAX_TOKENS)["tokens"]
        one = first.generate(prompts[0], max_tokens=MAX_TOKENS)
    finally:
        plain.__exit__(None, None, None)
        first.__exit__(None, None, None)
    assert one["num_cached_tokens"] == 0 and window_saves(log, 0) == [(len(prompts[0]) - 1) // 128 * 128]
    with VllmProcess(opts(model_dir, store, log)) as second:
        before = len(log.read_text().splitlines())
        two = second.generate(prompts[1], max_tokens=MAX_TOKENS)
    assert two["num_cached_tokens"] == 0   # blocks to 640, no window in reach: computed, the window kept
    assert window_saves(log, before) == [SHARED, (len(prompts[1]) - 1) // 128 * 128]
    with VllmProcess(opts(model_dir, store, log)) as third:
        three = third.generate(prompts[2], max_tokens=MAX_TOKENS)
    assert three["num_cached_tokens"] == SHARED and three["kv_transfer_params"]["kvledger"]["window_at"] == SHARED
    assert three["tokens"] == reference
