"""`kvledger serve` driven by the official `openai` client: completion, chat, streaming; hits
after a restart; tenants never share; a wrong key gets 401."""

import threading
import time

import openai
import pytest

from kvledger.util.serve_process import ServeProcess
from tests.entrypoint.conftest import ALPHA, BETA

BLOCK = 128
# a system prompt long enough for a few 128-token blocks; words, so the tokenizer is exercised
SYSTEM = ("You are the support assistant of a small bookshop. " + " ".join(
    f"Rule {i}: answer politely, name the shelf of book {i}, and never invent a price." for i in range(12)))
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is book 7?"}]


def client(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(c: openai.OpenAI):
    return c.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=6, temperature=0)


def hit_cap(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK * BLOCK   # SmolLM2: full attention, R = 1


def test_chat_hits_again_after_restart_and_never_across_keys(shared_server):
    server = shared_server.server
    first = _while_polling_health(server, lambda: chat(client(server, ALPHA)))
    assert first.usage.prompt_tokens > 2 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client(server, ALPHA))
    cap = hit_cap(second.usage.prompt_tokens)
    assert second.usage.prompt_tokens_details.cached_tokens == cap > 0
    u = second.usage.model_dump()
    assert u["prompt_cache_hit_tokens"] == cap
    assert u["prompt_cache_hit_tokens"] + u["prompt_cache_miss_tokens"] == u["prompt_tokens"]
    assert u["kvledger"]["device_cached_tokens"] == cap and u["kvledger"]["store_cached_tokens"] == 0
    assert second.choices[0].message.content == first.choices[0].message.content
    other = chat(client(server, BETA))
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == first.choices[0].message.content
    with pytest.raises(openai.AuthenticationError) as e:
        chat(client(server, "sk-wrong-0000000000"))
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    server = shared_server.restart()   # SIGTERM, then a new process on the same data directory
    again = chat(client(server, ALPHA))
    assert again.usage.prompt_tokens_details.cached_tokens == cap
    assert again.usage.model_dump()["kvledger"] == {"hit_kind": "full", "device_cached_tokens": 0,
                                                     "store_cached_tokens": cap,
                                                     "computed_prompt_tokens": again.usage.prompt_tokens - cap,
                                                     "engine": None, "legs": None}
    assert again.choices[0].message.content == first.choices[0].message.content
    _completion_and_streams(server)


def _while_polling_health(server: ServeProcess, call):
    """Run `call` in a thread while /health is polled: the engine's step loop never blocks the routes."""
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("r", call()))
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.perf_counter()
        status, _ = server.get("/health")
        slowest = max(slowest, time.perf_counter() - t0)
        assert status == 200
        time.sleep(0.05)
    worker.join()
    assert slowest < 2.0, f"/health took {slowest:.2f} s during a prefill"
    return box["r"]


def _completion_and_streams(server: ServeProcess) -> None:
    c = client(server, ALPHA)
    prompt = SYSTEM + "\nThe shelf of book 3 is"
    full = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens >= 1
    chunks = list(c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == hit_cap(full.usage.prompt_tokens)
    stream = c.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].usage.prompt_tokens_details.cached_tokens == hit_cap(parts[-1].usage.prompt_tokens)
    assert text == chat(c).choices[0].message.content
