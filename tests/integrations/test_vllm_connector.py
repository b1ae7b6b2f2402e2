"""kvledger under a real vLLM (CPU build, `.venv-vllm`), SmolLM2-135M, a 600-token prompt.

Three engine processes, two at a time: a plain vLLM (the reference output) beside vLLM with the
connector on an empty store (it computes and saves); then a fresh vLLM with the connector on the
same store: it loads the prompt's blocks (vLLM reports them), answers the same greedy tokens; a
corrupted block file gives a recompute of the lost blocks and again the same tokens; the next
request hits in full again (the recomputed block was stored anew). A prompt of whole blocks (640
tokens) hits all but its last token: vLLM computes that one token into the loaded last block, and
answers what the connector's engine answered cold (whose cold answers are the plain engine's: the
first prompt shows it).

The engines run in float32: a hit computes the last prompt tokens in a batch of another shape
than a cold prefill, and in bf16 that reordering of sums alone can flip a greedy token after a
few steps (measured here: token 8 of 16). The plain engine also answers from vLLM's own prefix
cache, the same computation as a connector hit, which must match exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.core import chain_keys
from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess, wait_all
from kvledger.engine.models.model_files import folder_digest
from kvledger.integrations.vllm.config import KvGeometry, connector_spec
from kvledger.integrations.vllm.identity import ModelIdentity
from kvledger.integrations.vllm.prompts import long_prompt
from kvledger.store.ledger import BlockLedger

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")]

# Short prompts: vLLM's CPU build prefills SmolLM2 in float32 at about 130 tokens/s on a 2-core AMD EPYC (a
# 2,000-token prompt took 14-18 s on both cores), and nothing checked here grows with the length.
PROMPT_TOKENS = 600
HIT = (PROMPT_TOKENS - 1) // 128 * 128  # 512: every full block (the last 88 tokens are in none)
WHOLE_TOKENS = 640                      # 5 whole blocks: the hit is 639 tokens
MAX_TOKENS = 16
GEOMETRY = KvGeometry(30, 3, 64, 4, "cpu", "float32")
DTYPE = "float32"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from kvledger.engine.models.registry import resolve

    return resolve("smollm2-135m").weights.folder()


@pytest.fixture(scope="module")
def spec(model_dir: Path):
    """The connector's spec: the folder's weights, computed in float32, salted with the name the tests give."""
    return connector_spec(ModelIdentity(folder_digest(model_dir), DTYPE, salt="smollm2-135m"), GEOMETRY)


def kvledger_opts(model_dir: Path, store: Path, events: Path) -> dict:
    return {"model": str(model_dir), "connector": "kvledger", "store": str(store), "events": str(events),
            "model_name": "smollm2-135m", "dtype": DTYPE}


def corrupt_block(store: Path, key: bytes) -> None:
    """Flip one byte in the middle of the block stored under `key` (found through the store's index)."""
    from kvledger.store.lmdb_store import LmdbStore

    with LmdbStore(store) as s, s.index.env.begin() as txn:
        rec = s.index.block(txn, key)
        path = store / s.index.seg(txn, rec.seg).path
    data = bytearray(path.read_bytes())
    data[rec.offset + rec.size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompt_saved_by_one_vllm_is_loaded_by_a_fresh_one(tmp_path, model_dir, spec, run_cli):
    store, log = tmp_path / "store", tmp_path / "events.jsonl"
    prompt, whole = long_prompt(PROMPT_TOKENS), long_prompt(WHOLE_TOKENS, variant=1)
    plain = VllmProcess({"model": str(model_dir), "connector": None, "dtype": DTYPE, "prefix_caching": True})
    first = VllmProcess(kvledger_opts(model_dir, store, log))
    wait_all([plain, first])
    try:
        reference = plain.generate(prompt, max_tokens=MAX_TOKENS)["tokens"]
        local = plain.generate(prompt, max_tokens=MAX_TOKENS)  # vLLM's own prefix cache: the shape of a hit
        cold = first.generate(prompt, max_tokens=MAX_TOKENS)
        reference_whole = first.generate(whole, max_tokens=MAX_TOKENS)["tokens"]
    finally:
        plain.__exit__(None, None, None)
        first.__exit__(None, None, None)
    assert len(reference) == MAX_TOKENS and cold["tokens"] == reference
    assert local["num_cached_tokens"] == HIT
    assert cold["kv_transfer_params"]["kvledger"]["loaded_tokens"] == 0
    assert sum(e["ok"] for e in events(log) if e["event"] == "save") == (PROMPT_TOKENS + WHOLE_TOKENS) // 128

    # kvledger's own CHECK and CLI see what vLLM stored
    with BlockLedger.open(store) as ledger:
        assert ledger.match_tokens(prompt, spec)[1] == PROMPT_TOKENS // 128
    stats = json.loads(run_cli("store", "stats", "--path", str(store), "--json").stdout)
    assert stats["blocks"] == (PROMPT_TOKENS + WHOLE_TOKENS) // 128

    with VllmProcess(kvledger_opts(model_dir, store, log)) as fresh:
        hit = fresh.generate(prompt, max_tokens=MAX_TOKENS)
        assert hit["tokens"] == local["tokens"] == reference
        assert hit["num_cached_tokens"] == HIT
        assert hit["kv_transfer_params"]["kvledger"] == {"namespace": "default", "loaded_tokens": HIT,
                                                         "failed_blocks": 0}
        before = len(events(log))
        hit_whole = fresh.generate(whole, max_tokens=MAX_TOKENS)
        assert hit_whole["tokens"] == reference_whole
        assert hit_whole["num_cached_tokens"] == WHOLE_TOKENS - 1
        assert hit_whole["kv_transfer_params"]["kvledger"]["loaded_tokens"] == WHOLE_TOKENS - 1
        assert [(e["event"], e["ok"]) for e in events(log)[before:]] == [("load", WHOLE_TOKENS // 128)]  # no save

        corrupt_block(store, chain_keys(prompt, spec)[HIT // 256])   # the middle block of the prompt
        before = len(events(log))
        fallback = fresh.generate(prompt, max_tokens=MAX_TOKENS)
        assert fallback["tokens"] == reference
        report = fallback["kv_transfer_params"]["kvledger"]
        assert report["failed_blocks"] > 0 and report["loaded_tokens"] == HIT - 128 * report["failed_blocks"]
        (load,) = [e for e in events(log)[before:] if e["event"] == "load"]
        assert load["ok"] == report["loaded_tokens"] // 128

        healed = fresh.generate(prompt, max_tokens=MAX_TOKENS)
        assert healed["tokens"] == reference
        assert healed["kv_transfer_params"]["kvledger"]["loaded_tokens"] == HIT
