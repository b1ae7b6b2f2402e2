"""The review's eviction case through a real `kvledger serve --model tiny-v4`: two tenant keys (and an operator key),
a small `--store-capacity` and no other flag. Tenant alpha's 600-token prompt hits 384 tokens; tenant beta then
sends unique prompts worth twice the capacity; alpha's next request must still hit. With `--api-keys` each
namespace is guaranteed capacity / (2 × namespaces) by default (store/quota.py); before quotas the flood left
alpha nothing (cause `evicted`). A device pool of one request (as test_serve_store_limits.py) leaves the block
ledger, not the engine's device prefix cache, to decide what a later request finds."""

from __future__ import annotations

import json
import time

from kvledger.util.serve_process import ServeProcess
from tests.entrypoint.conftest import ALPHA, BETA, OPERATOR, OPS
from tests.entrypoint.metrics_text import metric

KEYS = {ALPHA: "alpha", BETA: "beta", OPS: {"namespace": "ops", "role": "operator"}}
BLOCK = 18_816                     # tiny-v4's block bytes
CAPACITY = 32 * BLOCK              # 602,112 B: each of 3 namespaces is guaranteed 100,352 B (5 blocks) by default
SMALL_DEVICE = ("--kv-cache-bytes", "1", "--max-prompt-tokens", "1024", "--max-tokens-limit", "4")
FLOOD = 16                         # beta's unique 600-token prompts: 16 × 4 blocks = 2 × the capacity
HIT = 384                          # ⌊(600 − 134) / 128⌋ · 128


def _cached(server: ServeProcess, key: str, first: int) -> dict:
    body = {"model": "tiny-v4", "prompt": list(range(first, first + 600)), "max_tokens": 2, "temperature": 0}
    status, out = server.post("/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
    assert status == 200, out
    return out["usage"]


def test_a_tenant_keeps_its_hit_through_another_tenants_flood(tmp_path, run_cli):
    server = ServeProcess(tmp_path / "data", *SMALL_DEVICE, "--store-capacity", str(CAPACITY), model="tiny-v4",
                          keys=KEYS).start()
    try:
        assert _cached(server, ALPHA, 1)["prompt_tokens_details"]["cached_tokens"] == 0
        assert _cached(server, BETA, 25_000)["prompt_tokens_details"]["cached_tokens"] == 0   # out of the device
        assert _cached(server, ALPHA, 1)["prompt_tokens_details"]["cached_tokens"] == HIT     # from the ledger
        started = time.monotonic()
        for i in range(FLOOD):
            _cached(server, BETA, 2_000 + 700 * i)
        flood_s = time.monotonic() - started
        assert _cached(server, ALPHA, 1)["prompt_tokens_details"]["cached_tokens"] == HIT, (
            f"alpha lost its prefix to beta's flood of {FLOOD} prompts in {flood_s:.1f} s")
        status, text = server.get("/metrics", headers=OPERATOR)
        assert status == 200
        text = text.decode()
        guarantee = CAPACITY // 6
        assert metric(text, "kvledger_store_namespace_guarantee_bytes", namespace="alpha") == guarantee
        assert metric(text, "kvledger_store_evictions_total") > 0
        assert 0 < metric(text, "kvledger_store_namespace_bytes", namespace="alpha") <= guarantee
        assert metric(text, "kvledger_store_quota_overrides_total") == 0
    finally:
        server.stop()
    out = run_cli("store", "stats", "--path", str(tmp_path / "data"), "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["guarantees"]["namespaces"] == {"alpha": CAPACITY // 6, "beta": CAPACITY // 6, "ops": CAPACITY // 6}
    assert 0 < st["namespace_bytes"]["alpha"] <= CAPACITY // 6 and st["live_bytes"] <= CAPACITY


def test_up_hands_every_child_the_guarantees_it_resolved_once(tmp_path):
    """`kvledger up` resolves the key file's default shares and `--quota` once; an engine, which knows no key file,
    gets them as explicit flags (so does the entrypoint, whose own resolution then gives the same)."""
    import argparse

    from kvledger.entrypoint.up import store_flags

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({ALPHA: "alpha", BETA: {"namespace": "beta", "quota": "300KB"}}))
    keys.chmod(0o600)
    args = argparse.Namespace(store_capacity="1MB", quota=["agent=100KB"], api_keys=keys)
    assert store_flags(args) == ["--store-capacity", "1000000", "--quota", "namespace:alpha=250000",
                                 "--quota", "namespace:beta=300000", "--quota", "class:agent=100000"]
    assert store_flags(argparse.Namespace(store_capacity=None, quota=[], api_keys=None)) == []
