"""The engine's wire records: what an engine process streams back to the entrypoint (cluster mode)."""

from kvledger.engine.api import RequestUsage, TokenEvent
from kvledger.engine.wire import WireEvent


def test_usage_crosses_the_wire_with_what_the_fetcher_read_and_missed():
    usage = RequestUsage(600, 256, 2, "fallback", 0.5, {"fetch_s": 0.01}, 128, None, fetch_bytes=18816,
                         fetch_misses={"corrupt": 1}, preemptions=2, recomputed_tokens=700)
    line = WireEvent.of(TokenEvent("r", (7,), False, None, usage), "prefill-0").line()
    back = WireEvent.model_validate_json(line).token_event("r").usage
    assert back is not None
    assert (back.preemptions, back.recomputed_tokens) == (2, 700)
    assert (back.fetch_bytes, back.fetch_misses, back.engine) == (18816, {"corrupt": 1}, "prefill-0")
    assert (back.cached_tokens, back.device_cached_tokens, back.timings) == (256, 128, {"fetch_s": 0.01})


def test_an_answer_no_engine_of_ours_sends_is_refused():
    """Issue 20 item 1: a fake engine's `cached_tokens=-5` drove a Prometheus counter negative (a 500), and its
    invented tokens reached the tenant. The entrypoint refuses such an event (the leg counts as broken)."""
    import pytest

    ok = {"prompt_tokens": 700, "cached_tokens": 512, "completion_tokens": 1, "hit_kind": "snapshot",
          "device_cached_tokens": 0, "ttft_s": 0.1}
    assert WireEvent(token_ids=[5], usage=ok).token_event("r", vocab_size=100).token_ids == (5,)
    bad = [{"token_ids": [100]}, {"token_ids": [-1]}, {"finish_reason": "because"},
           {"usage": ok | {"cached_tokens": -5}}, {"usage": ok | {"cached_tokens": 701}},
           {"usage": ok | {"device_cached_tokens": 600}}, {"usage": ok | {"hit_kind": "oracle"}},
           {"usage": ok | {"ttft_s": float("nan")}}, {"usage": ok | {"fetch_misses": {"absent": -1}}}]
    for fields in bad:
        with pytest.raises(ValueError):
            WireEvent(**({"token_ids": [5]} | fields)).token_event("r", vocab_size=100)


FITS = {"vocab_size": 49152, "max_model_len": 8192}   # smollm2-135m's vocabulary and context


def test_a_leg_carries_the_entrypoints_keys_and_decision():
    """Keys and the decision are computed once, by the entrypoint's CHECK, and carried; the engine checks them
    (the first key against its namespace's root, the decision against the prompt) without hashing the prompt."""
    import numpy as np
    import pytest

    from kvledger.core import ModelSpec, chain_keys, decide_hit
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.engine.wire import GenerateBody

    spec = ModelSpec.preset("smollm2-135m")
    tokens = np.arange(1000, dtype=np.uint32)
    req = EngineRequest("r.1", tokens, chain_keys(tokens, spec, "t"), decide_hit(1000, 5, (), spec),
                        SamplingParams(max_tokens=3), "t")
    body = GenerateBody.of(req, wait_stored=True)
    back = GenerateBody.model_validate_json(body.model_dump_json()).engine_request(spec, **FITS)
    assert (back.keys, back.decision, back.namespace, list(back.tokens)) == (req.keys, req.decision, "t", list(tokens))
    assert back.store
    quiet = GenerateBody.of(EngineRequest("r.2", tokens, req.keys, req.decision, req.sampling, "t", store=False))
    assert not GenerateBody.model_validate_json(quiet.model_dump_json()).engine_request(spec, **FITS).store   # rule 12
    wrong = [GenerateBody.of(EngineRequest("r", tokens, chain_keys(tokens, spec, "other"), req.decision, req.sampling,
                                           "t")),
             GenerateBody.of(EngineRequest("r", tokens, req.keys[:-1], req.decision, req.sampling, "t")),
             GenerateBody.of(EngineRequest("r", tokens, req.keys, decide_hit(2000, 5, (), spec), req.sampling, "t"))]
    for bad in wrong:
        with pytest.raises(ValueError, match="keys|decision"):
            bad.engine_request(spec, **FITS)


def test_a_leg_is_refused_where_it_enters_the_engine_process():
    """Keys made for another namespace, a decision no CHECK could make for this prompt, tokens past the vocabulary
    or the context: a ValueError (the engine process's 400) before the engine sees the leg."""
    import numpy as np
    import pytest

    from kvledger.core import ModelSpec, chain_keys, decide_hit
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.engine.wire import GenerateBody

    spec, sp = ModelSpec.preset("smollm2-135m"), SamplingParams(max_tokens=4)
    prompt = np.arange(1, 501, dtype=np.uint32)
    good = decide_hit(500, 0, set(), spec)

    def leg(tokens, keys, decision) -> GenerateBody:
        return GenerateBody.of(EngineRequest("x", tokens, keys, decision, sp))

    leg(prompt, chain_keys(prompt, spec), good).engine_request(spec, **FITS)
    with pytest.raises(ValueError, match="keys"):
        leg(prompt, chain_keys(prompt, spec, "other"), good).engine_request(spec, **FITS)
    with pytest.raises(ValueError, match="decision"):
        leg(prompt, chain_keys(prompt, spec), decide_hit(900, 7, set(), spec)).engine_request(spec, **FITS)
    long = np.full(FITS["max_model_len"], 5, dtype=np.uint32)
    with pytest.raises(ValueError, match="context"):
        leg(long, chain_keys(long, spec), decide_hit(long.size, 0, set(), spec)).engine_request(spec, **FITS)
    with pytest.raises(ValueError, match="token ids"):
        leg(prompt, chain_keys(prompt, spec), good).engine_request(spec, vocab_size=500, max_model_len=8192)


def test_a_leg_carries_its_rule_4pp_positions_and_only_block_boundaries():
    import numpy as np
    import pytest

    from kvledger.core import ModelSpec, chain_keys, decide_hit
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.engine.wire import GenerateBody

    spec = ModelSpec.preset("gemma3-270m")
    tokens = np.arange(1, 1501, dtype=np.uint32)
    fits = {"vocab_size": 262144, "max_model_len": 32768}
    req = EngineRequest("r", tokens, chain_keys(tokens, spec), decide_hit(1500, 0, (), spec),
                        SamplingParams(max_tokens=1), snapshot_at=(1024, 1152))
    back = GenerateBody.model_validate_json(GenerateBody.of(req).model_dump_json()).engine_request(spec, **fits)
    assert back.snapshot_at == (1024, 1152)
    odd = GenerateBody.of(EngineRequest("r", tokens, req.keys, req.decision, req.sampling, snapshot_at=(1000,)))
    with pytest.raises(ValueError, match="snapshot_at"):
        odd.engine_request(spec, **fits)
