"""A 32K-token prompt: cold prefill in seconds of one core, and an exact snapshot hit (slow).

`pytest -m slow -s tests/engine/models/test_tiny_v4_long.py` prints the figures."""

import time

import pytest
import torch

from kvledger.core.hit import HitKind, decide_hit, prefill_store_positions
from tests.engine.models.tiny_v4_paths import ledger_blocks, max_rel_err, prefill_cold, prefill_hit
from kvledger.engine.models.tiny_v4_state import snapshot_bytes
from tests.engine.models.tiny_v4_helpers import prompt, tiny_v4  # noqa: F401


def timed(fn, *args, **kw):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kw)
    return out, time.perf_counter() - wall, time.process_time() - cpu


@pytest.mark.slow
def test_32k_prefill_and_hit(tiny_v4):  # noqa: F811
    spec, tokens = tiny_v4.spec, prompt(32768, seed=30)
    (state, cold), cold_wall, cold_cpu = timed(prefill_cold, tiny_v4, tokens, chunk=4096)
    c = prefill_store_positions(len(tokens), spec)[0]
    blocks, snap = ledger_blocks(tiny_v4, state, c // 128), snapshot_bytes(state, spec, c)
    decision = decide_hit(len(tokens), len(blocks), {c}, spec)
    assert decision.kind is HitKind.SNAPSHOT
    (_, hit), hit_wall, hit_cpu = timed(prefill_hit, tiny_v4, tokens, decision, blocks, snap)
    print(f"\ntiny-v4 32K, one thread: cold {cold_cpu:.1f} s CPU ({cold_wall:.1f} s wall), "
          f"snapshot hit {hit_cpu:.2f} s CPU ({hit_wall:.2f} s wall)")
    assert max_rel_err(hit, cold) <= 1e-4 and torch.equal(hit, cold)
    assert cold_cpu < 30, f"cold 32K prefill took {cold_cpu:.1f} s of CPU"
    assert hit_cpu < 0.1 * cold_cpu, f"hit {hit_cpu:.2f} s vs cold {cold_cpu:.2f} s of CPU"
