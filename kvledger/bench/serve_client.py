"""A small blocking client of `kvledger serve`: one streamed /v1/completions call with token ids
(`kvledger bench serve`) or one streamed chat turn (`kvledger demo`), timed on the client side
(standard library only: neither needs an HTTP package).

TTFT = request sent → first SSE chunk that carries a generated token (seconds, perf_counter).
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


class ServeError(RuntimeError):
    """The server answered with an error (its message included)."""


@dataclass(frozen=True, slots=True)
class Reply:
    token_ids: tuple[int, ...]   # completions with token ids; () for a chat turn
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    text: str = ""               # a chat turn's reply, as generated


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int, *,
                cache_salt: str | None = None, timeout_s: float = 600.0) -> Reply:
    """One greedy chat turn, streamed, usage in the last chunk. `cache_salt` puts it in a namespace of its own."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return _post_stream(url, "/v1/chat/completions", json.dumps(body), None, timeout_s)


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, *, api_key: str | None = None,
                      timeout_s: float = 600.0) -> Reply:
    """Greedy, `ignore_eos` (every run generates the same number of tokens), usage in the last chunk."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    return _post_stream(url, "/v1/completions", body, api_key, timeout_s)


def _post_stream(url: str, path: str, body: str, api_key: str | None, timeout_s: float) -> Reply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        return _read_stream(resp, t0)
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, t0: float) -> Reply:
    ids: list[int] = []
    text: list[str] = []
    ttft = None
    usage = None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise ServeError(chunk["error"].get("message", "error"))
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if choice.get("token_ids") or piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(choice.get("token_ids") or ())
                text.append(piece or "")
        usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise ServeError("the stream ended without tokens or usage")
    return Reply(tuple(ids), usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], ttft,
                 time.perf_counter() - t0, "".join(text))
