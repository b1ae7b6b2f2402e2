"""The request path before the engine: prompt text too long to fit is refused by its bytes before any
tokenizing, and tokenizing runs in a worker thread, so big prompts never stall the event loop."""

import threading
import time
from types import SimpleNamespace

import pytest

from kvledger.entrypoint.errors import ApiError
from kvledger.cli import build_parser
from kvledger.entrypoint.prepare import refuse_oversized_text, sampling_params
from kvledger.entrypoint.protocol import ChatCompletionRequest, CompletionRequest
from kvledger.entrypoint.server_state import ServeConfig
from kvledger.util.serve_process import ServeProcess

MODEL = "smollm2-135m"
TEXT = "The quick brown fox, 1234 of them, jumps over the lazy dog. "
HUGE = (TEXT * 70_000)[:3_900_000]   # 3.9 MB: over any context of SmolLM2's by its bytes alone
LONG = HUGE[:1_000_000]              # under the byte bound (8,191 tokens × 162 B): tokenized, then refused


def test_health_stays_fast_while_big_prompts_are_refused(tmp_path):
    """Four 3.9 MB prompts, each a 400 in the end, were tokenized on the event loop: /health took 7.25 s."""
    server = ServeProcess(tmp_path / "data").start()   # default limits: 4 MiB bodies, the whole context
    try:
        results: list = []

        def post(prompt: str) -> None:
            results.append(server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}))

        senders = [threading.Thread(target=post, args=(p,)) for p in (HUGE, LONG, HUGE, LONG)]
        for t in senders:
            t.start()
        waits = []
        while any(t.is_alive() for t in senders) or len(waits) < 3:
            t0 = time.perf_counter()
            assert server.get("/health")[0] == 200
            waits.append(time.perf_counter() - t0)
        for t in senders:
            t.join()
        assert max(waits) < 1.0, waits
        assert sorted(s for s, _ in results) == [400] * 4, results
        assert {b["error"]["code"] for _, b in results} == {"context_length_exceeded"}
        messages = [b["error"]["message"] for _, b in results]
        assert sum("bytes of text; this server takes at most 8191 tokens" in m for m in messages) == 2, messages
    finally:
        server.stop()


def test_the_byte_bound_counts_every_message_and_names_the_limit():
    state = SimpleNamespace(tokenizer=object(), max_token_bytes=10, max_model_len=100,
                            config=SimpleNamespace(max_prompt_tokens=20))   # at most 20 tokens: 200 bytes
    fits = [{"role": "system", "content": "é" * 50}, {"role": "user", "content": [{"type": "text", "text": "x" * 100}]}]
    refuse_oversized_text(state, ChatCompletionRequest.model_validate({"model": "m", "messages": fits}))
    refuse_oversized_text(state, CompletionRequest.model_validate({"model": "m", "prompt": [1] * 500}))  # ids: counted
    over = fits + [{"role": "user", "content": "y"}]
    with pytest.raises(ApiError) as e:
        refuse_oversized_text(state, ChatCompletionRequest.model_validate({"model": "m", "messages": over}))
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "prompt_too_long")
    assert "201 bytes" in e.value.message and "at most 20 tokens" in e.value.message
    with pytest.raises(ApiError) as e:
        refuse_oversized_text(state, CompletionRequest.model_validate({"model": "m", "prompt": "z" * 201}))
    assert e.value.param == "prompt"


@pytest.mark.parametrize("command", ["serve", "entrypoint", "up"])
def test_max_tokens_is_limited_by_default_not_by_the_context(command):
    """`max_tokens=131069` on tiny-v4's 131,072-token context was accepted: one request held a batch slot for
    hours. The default limit is stated, and a request over it is a 400 that names it."""
    required = ["--redis-url", "redis://x", "--data-dir", "/tmp/x"] if command == "entrypoint" else []
    limit = build_parser().parse_args([command, *required]).max_tokens_limit
    assert limit == ServeConfig().max_tokens_limit == 4096
    state = SimpleNamespace(config=ServeConfig(model="tiny-v4"), max_model_len=131072, vocab_size=1024)
    body = CompletionRequest(model="tiny-v4", prompt=[1, 2, 3], max_tokens=131069)
    with pytest.raises(ApiError) as e:
        sampling_params(state, body, 3)
    assert (e.value.status, e.value.code, e.value.param) == (400, "max_tokens_too_large", "max_tokens")
    assert "at most 4096 tokens" in e.value.message
    fits = CompletionRequest(model="tiny-v4", prompt=[1, 2, 3], max_tokens=4096)
    assert sampling_params(state, fits, 3).max_tokens == 4096
