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
