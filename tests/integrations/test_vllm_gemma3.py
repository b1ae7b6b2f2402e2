"""kvledger under a real vLLM (CPU build, `.venv-vllm`) with vLLM's hybrid KV cache manager on:
Gemma 3 270M (15 sliding-window layers, W = 512, and 3 full-attention layers), float32, a prompt of
1,000 tokens, longer than the window.

Two engines at once: a plain vLLM (the reference greedy tokens; asked twice, the second time from its
own prefix cache) beside vLLM with the connector on an empty store (it computes, saves the full
group's 7 blocks to the block ledger and the window [384, 896) of the sliding-window groups as
the snapshot at p = ⌊(L − 1)/128⌋·128 = 896). Then a fresh vLLM with the connector on the same
store: vLLM reports 896 cached tokens (rule 3′ with R = 1: the blocks up to 896 and the snapshot
there), loaded from kvledger, and answers the plain engine's tokens; a next turn (the prompt and
300 more tokens: L1 = 896 < its cap 1280) resumes at the same snapshot. A corrupted snapshot file then
ends in a recompute from 0 with the same tokens (rule 8), which saves the snapshot anew: the next
request hits again.

Float32 for the reason test_vllm_connector.py gives: a hit computes the last 104 prompt tokens in a
batch of another shape than a cold prefill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.core import LayerKind, chain_keys
from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess, wait_all
from kvledger.engine.models.model_files import folder_digest
from kvledger.integrations.vllm.config import KvGeometry, connector_spec
from kvledger.integrations.vllm.identity import ModelIdentity
from kvledger.integrations.vllm.prompts import long_prompt
from kvledger.state.files import SnapshotFiles
from kvledger.store.ledger import BlockLedger

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")

PROMPT_TOKENS = 1000
HIT = (PROMPT_TOKENS - 1) // 128 * 128   # 896: rule 4′'s p, and rule 3′'s hit for this prompt
NEXT_TURN = 300                          # tokens a next turn appends (its own p: 1280)
MAX_TOKENS = 16
DTYPE = "float32"
GEMMA_LAYERS = tuple(LayerKind.FULL if (i + 1) % 6 == 0 else LayerKind.SWA for i in range(18))
GEOMETRY = KvGeometry(18, 1, 256, 4, "cpu", "float32", GEMMA_LAYERS, 512)
SPEC = connector_spec(ModelIdentity("ef" * 32, DTYPE, salt="gemma3-270m"), GEOMETRY)   # the geometry's checks only
SNAPSHOT_BYTES = 15 * 512 * 2 * 256 * 4   # 15 SWA layers × W × (K, V) × 256 dims × float32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvledger.engine.models.registry import resolve

    return resolve("gemma3-270m").weights.folder()


@pytest.fixture(scope="module")
def spec(model_dir: Path):
    """The connector's spec: the folder's weights, computed in float32, salted with the name the test gives."""
    return connector_spec(ModelIdentity(folder_digest(model_dir), DTYPE, salt="gemma3-270m"), GEOMETRY)


def kvledger_opts(model_dir: Path, store: Path, events: Path) -> dict:
    return {"model": str(model_dir), "connector": "kvledger", "store": str(store), "events": str(events),
            "model_name": "gemma3-270m", "dtype": DTYPE, "max_model_len": 4096}


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_spec_of_gemma3_under_vllm_keeps_every_window_and_differs_by_dtype():
    assert SPEC.has_swa and SPEC.reserve_tokens == 1 and SPEC.window == 512
    assert SPEC.block_bytes() == 128 * 3 * 2 * 256 * 4 and SPEC.state_size_to_disk() == SNAPSHOT_BYTES
    identity = ModelIdentity("ef" * 32, DTYPE, salt="gemma3-270m")
    bf16 = connector_spec(identity, KvGeometry(18, 1, 256, 2, "cpu", "bfloat16", GEMMA_LAYERS, 512))
    other_window = connector_spec(identity, KvGeometry(18, 1, 256, 4, "cpu", "float32", GEMMA_LAYERS, 1024))
    assert len({SPEC.fingerprint(), bf16.fingerprint(), other_window.fingerprint()}) == 3


@pytest.mark.vllm
@needs_vllm
def test_gemma3_window_and_blocks_saved_by_one_vllm_are_loaded_by_a_fresh_one(tmp_path, model_dir, spec):
    store, log = tmp_path / "store", tmp_path / "events.jsonl"
    prompt = long_prompt(PROMPT_TOKENS, model="gemma3-270m", bos=2)
    next_turn = prompt + long_prompt(NEXT_TURN + 1, variant=1, model="gemma3-270m", bos=2)[1:]
    plain = VllmProcess({"model": str(model_dir), "connector": None, "dtype": DTYPE, "prefix_caching": True,
                         "max_model_len": 4096})
    first = VllmProcess(kvledger_opts(model_dir, store, log))
    wait_all([plain, first])
    try:
        assert plain.hybrid_kv_cache_manager and first.hybrid_kv_cache_manager
        reference = plain.generate(prompt, max_tokens=MAX_TOKENS)["tokens"]
        local = plain.generate(prompt, max_tokens=MAX_TOKENS)  # vLLM's own prefix cache: the shape of a hit
        cold = first.generate(prompt, max_tokens=MAX_TOKENS)
        reference_next = plain.generate(next_turn, max_tokens=MAX_TOKENS)["tokens"]
    finally:
        plain.__exit__(None, None, None)
        first.__exit__(None, None, None)
    assert len(reference) == MAX_TOKENS and cold["tokens"] == reference
    assert local["tokens"] == reference
    assert cold["kv_transfer_params"]["kvledger"]["loaded_tokens"] == 0
    saved = events(log)
    assert sum(e["ok"] for e in saved if e["event"] == "save") == PROMPT_TOKENS // 128
    assert [(e["position"], e["ok"]) for e in saved if e["event"] == "window_save"] == [(HIT, 1)]
    with BlockLedger.open(store) as ledger:
        assert ledger.match_tokens(prompt, spec)[1] == PROMPT_TOKENS // 128
    keys = chain_keys(prompt, spec)
    snapshot = SnapshotFiles(store).read(keys[HIT // 128 - 1])
    assert snapshot is not None and snapshot[0] == HIT and len(snapshot[1]) == SNAPSHOT_BYTES

    with VllmProcess(kvledger_opts(model_dir, store, log)) as fresh:
        assert fresh.hybrid_kv_cache_manager
        before = len(events(log))
        hit = fresh.generate(prompt, max_tokens=MAX_TOKENS)
        assert hit["tokens"] == reference
        assert hit["num_cached_tokens"] == HIT
        assert hit["kv_transfer_params"]["kvledger"] == {"namespace": "default", "loaded_tokens": HIT,
                                                         "failed_blocks": 0, "window_at": HIT}
        assert [(e["event"], e["ok"]) for e in events(log)[before:] if e["event"] != "save"] == [
            ("window_load", 1), ("load", HIT // 128)]
        extended = fresh.generate(next_turn, max_tokens=MAX_TOKENS)
        assert extended["tokens"] == reference_next and extended["num_cached_tokens"] == HIT
        assert extended["kv_transfer_params"]["kvledger"]["window_at"] == HIT

        path = SnapshotFiles(store).path(keys[HIT // 128 - 1])   # rule 8: a damaged snapshot is a recompute
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        recomputed = fresh.generate(prompt, max_tokens=MAX_TOKENS)
        assert recomputed["tokens"] == reference
        report = recomputed["kv_transfer_params"]["kvledger"]
        assert report["loaded_tokens"] == 0 and report["failed_blocks"] > 0 and report["window_at"] == 0

        healed = fresh.generate(prompt, max_tokens=MAX_TOKENS)   # the recompute saved the window again
        assert healed["tokens"] == reference
        assert healed["kv_transfer_params"]["kvledger"]["loaded_tokens"] == HIT
