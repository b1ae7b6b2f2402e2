"""The replay's scaling (whole 128-token blocks, sharing kept) and its busy-period prefill rate: no server."""

import numpy as np
import pytest

from kvledger.bench.replay_client import ReplayOutcome
from kvledger.bench.replay_report import as_sent, busy_prefill_rate
from kvledger.bench.replay_scale import make_scaling, scale_trace
from kvledger.bench.trace import TraceRequest, Trace
from kvledger.bench.workloads import generate
from kvledger.core import ModelSpec, chain_keys

SPEC = ModelSpec.preset("smollm2-135m")


def _shared_blocks(a: np.ndarray, b: np.ndarray) -> int:
    ka, kb = chain_keys(a, SPEC), chain_keys(b, SPEC)
    n = 0
    while n < min(len(ka), len(kb)) and ka[n] == kb[n]:
        n += 1
    return n


def _shared_ids(a: TraceRequest, b: TraceRequest) -> int:
    n, bt = 0, a.block_tokens
    while (n < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[n] == b.hash_ids[n]
           and a.block_len(n) == bt and b.block_len(n) == bt):
        n += 1
    return n


@pytest.mark.parametrize(("bt", "scale", "stride", "per_id"), [(128, 0.25, 4, 1), (512, 0.25, 1, 1),
                                                               (512, 0.5, 1, 2), (128, 1.0, 1, 1)])
def test_a_shared_prefix_stays_shared_and_no_more(bt, scale, stride, per_id):
    """Every pair of prompts that share their first j ids shares exactly per_id·⌊j/stride⌋ scaled
    blocks (by kvledger's own chain keys); lengths are whole blocks plus a tail under one block."""
    trace = generate("chat", seed=3, sessions=6, block_tokens=bt)
    s = make_scaling(trace, scale, 1 << 20, 8, 10_000, None, None)
    assert (s.block_stride, s.blocks_per_id, s.factor) == (stride, per_id, per_id * 128 / (stride * bt))
    scaled = scale_trace(trace, s)
    for i in range(0, len(scaled), 3):
        for j in range(i + 1, len(scaled), 2):
            a, b = trace.requests[i], trace.requests[j]
            want = per_id * (_shared_ids(a, b) // stride)
            assert _shared_blocks(scaled[i].tokens, scaled[j].tokens) == want
    for r, src in zip(scaled, trace.requests):
        full = min(len(src.hash_ids), src.input_length // bt)
        assert r.tokens.size // 128 == per_id * (full // stride)
        assert r.sim.input_length == r.tokens.size and 1 <= r.max_tokens <= 8


def test_cap_output_and_time_factor():
    reqs = [TraceRequest(0.0, 40 * 128 + 5, 1000, tuple(range(1, 42)), 128),
            TraceRequest(100.0, 3 * 128, 0, (7, 8, 9), 128), TraceRequest(400.0, 10, 3, (), 128)]
    trace = Trace(tuple(reqs), "test")
    s = make_scaling(trace, 1.0, 1000, 16, 10, 40.0, None)
    assert s.max_prompt_tokens == 896 and s.time_factor == 0.1
    long_, whole, tiny = scale_trace(trace, s)
    assert long_.tokens.size == 896 and long_.max_tokens == 16      # capped to 7 whole blocks, tail dropped
    assert whole.tokens.size == 384 and whole.max_tokens == 1        # no partial block, at least one token out
    assert tiny.tokens.size == 10 and tiny.arrival_s == pytest.approx(40.0)
    assert [r.sim.arrival_s for r in (long_, whole, tiny)] == pytest.approx([0.0, 10.0, 40.0])
    with pytest.raises(ValueError, match="block sizes"):
        make_scaling(Trace((reqs[0], TraceRequest(1.0, 600, 1, (1, 2), 512)), "mixed"), 0.25, 1024, 4, 10, None, None)


def test_busy_rate_is_computed_tokens_over_the_union_of_prefill_intervals():
    def o(engine: str, sent: float, ttft: float, prompt: int, cached: int) -> ReplayOutcome:
        return ReplayOutcome(0, prompt, cached, engine=engine, ttft_s=ttft, latency_s=ttft, sent_at=sent)

    # engine a: [0, 4] ∪ [1, 3] ∪ [6, 7] = 5 s; engine b: [2, 5] = 3 s; computed 300 + 100 + 50 + 350
    outs = [o("a", 0, 4, 400, 100), o("a", 1, 2, 100, 0), o("a", 6, 1, 50, 0), o("b", 2, 3, 350, 0)]
    rate, busy = busy_prefill_rate(outs)
    assert busy == pytest.approx(8.0) and rate == pytest.approx(800 / 8.0)


def test_the_simulator_gets_the_requests_as_sent():
    trace = generate("chat", seed=1, sessions=2)
    scaled = scale_trace(trace, make_scaling(trace, 0.25, 1024, 4, 5, None, 1.0))
    sent = [ReplayOutcome(r.index, sent_at=r.arrival_s + (1e6 if r.index == 0 else 0.0)) for r in scaled]
    reqs = as_sent(scaled, sent)
    assert [r.arrival_s for r in reqs] == sorted(o.sent_at for o in sent)
    assert reqs[-1].hash_ids == scaled[0].sim.hash_ids and not any(r.output_hash_ids for r in reqs)
