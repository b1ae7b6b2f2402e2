"""The routing policies (rule 5) on made-up engines: pure logic, no processes."""

import pytest

from kvledger.engine.engine_registry import EngineInfo
from kvledger.entrypoint.router import POLICIES, Load, PromptView, Router


def engine(name: str, role: str = "prefill", running: int = 0, queued: int = 0) -> EngineInfo:
    return EngineInfo(name, role, f"http://127.0.0.1:1/{name}", "smollm2-135m", 8192, 49152, (2,), 1,
                      running=running, queued_prefill_tokens=queued)


def view(prefix: bytes = b"p" * 16, to_compute: int = 1000) -> PromptView:
    return PromptView(2000, to_compute, prefix)


def test_cache_aware_picks_the_lowest_queue_and_prefers_the_last_engine_of_a_prefix_on_ties():
    r = Router("cache-aware")
    a, b = engine("a", queued=5000), engine("b", queued=0)
    assert r.pick_prefill(view(), [a, b], {}).engine_id == "b"
    # the entrypoint's own count beats a stale heartbeat
    assert r.pick_prefill(view(), [a, b], {"b": Load(queued_prefill_tokens=9000)}).engine_id == "a"
    r2 = Router("cache-aware")
    c, d = engine("c"), engine("d")
    r2.pick_prefill(view(b"x" * 16), [d], {})                        # prefix x went to d
    assert r2.pick_prefill(view(b"x" * 16), [c, d], {}).engine_id == "d"
    assert r2.pick_prefill(view(b"y" * 16), [c, d], {}).engine_id == "c"


def test_round_robin_cycles_and_least_loaded_counts_running():
    r = Router("round-robin")
    engines = [engine("a"), engine("b"), engine("c")]
    assert [r.pick_prefill(view(), engines, {}).engine_id for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("least-loaded")
    assert ll.pick_prefill(view(), [engine("a", running=3), engine("b", running=1)], {}).engine_id == "b"
    assert ll.pick_prefill(view(), [engine("a", running=3), engine("b", running=1)],
                           {"b": Load(running=5)}).engine_id == "a"


def test_prefix_affinity_is_stable_and_moves_only_the_prefixes_of_a_removed_engine():
    r = Router("prefix-affinity")
    engines = [engine(n) for n in "abcd"]
    prefixes = [bytes([i]) * 16 for i in range(200)]
    first = {p: r.pick_prefill(view(p), engines, {}).engine_id for p in prefixes}
    assert first == {p: r.pick_prefill(view(p), engines, {}).engine_id for p in prefixes}
    assert len(set(first.values())) == 4                       # spread over all engines
    without_d = {p: r.pick_prefill(view(p), engines[:3], {}).engine_id for p in prefixes}
    assert all(without_d[p] == first[p] for p in prefixes if first[p] != "d")


def test_decode_by_load_and_unknown_policy_refused():
    r = Router()
    assert r.pick_decode([engine("a", "decode", running=2), engine("b", "decode", running=0)], {}).engine_id == "b"
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random")
    assert "cache-aware" in POLICIES
