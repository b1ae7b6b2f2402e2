"""The engine's wire records: what an engine process streams back to the entrypoint (cluster mode)."""

from kvledger.engine.api import RequestUsage, TokenEvent
from kvledger.engine.wire import WireEvent


def test_usage_crosses_the_wire_with_what_the_fetcher_read_and_missed():
    usage = RequestUsage(600, 256, 2, "fallback", 0.5, {"fetch_s": 0.01}, 128, None, fetch_bytes=18816,
                         fetch_misses={"corrupt": 1})
    line = WireEvent.of(TokenEvent("r", (7,), False, None, usage), "prefill-0").line()
    back = WireEvent.model_validate_json(line).token_event("r").usage
    assert back is not None
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
