"""A 32K-token prompt: cold prefill in seconds, and an exact snapshot hit (slow)."""

import time

import pytest
import torch

from kvledger.core.hit import HitKind, decide_hit, prefill_store_positions
from kvledger.engine.models.tiny_v4_paths import ledger_blocks, max_rel_err, prefill_cold, prefill_hit
from kvledger.engine.models.tiny_v4_state import snapshot_bytes
from tests.engine.models.tiny_v4_helpers import prompt, tiny_v4  # noqa: F401


@pytest.mark.slow
def test_32k_prefill_and_hit(tiny_v4):  # noqa: F811
    spec, tokens = tiny_v4.spec, prompt(32768, seed=30)
    start = time.perf_counter()
    state, cold = prefill_cold(tiny_v4, tokens, chunk=4096)
    cold_s = time.perf_counter() - start
    c = prefill_store_positions(len(tokens), spec)[0]
    blocks, snap = ledger_blocks(tiny_v4, state, c // 128), snapshot_bytes(state, spec, c)
    decision = decide_hit(len(tokens), len(blocks), {c}, spec)
    assert decision.kind is HitKind.SNAPSHOT
    start = time.perf_counter()
    _, hit = prefill_hit(tiny_v4, tokens, decision, blocks, snap)
    hit_s = time.perf_counter() - start
    assert max_rel_err(hit, cold) <= 1e-4 and torch.equal(hit, cold)
    assert cold_s < 120, f"cold 32K prefill took {cold_s:.1f} s"
    assert hit_s < 0.1 * cold_s, f"hit {hit_s:.2f} s vs cold {cold_s:.2f} s"
