"""One streamed `/v1/completions` call of the live replay, timed on the client (standard library).

The request: token-id prompt, `max_tokens`, `temperature` 0, `ignore_eos` (every run generates
the same number of tokens), `stream` with `stream_options.include_usage`, and the run's
`cache_salt` (a fresh salt per run keeps blocks an earlier run left on the server from counting
as hits). TTFT = request sent → the first SSE chunk that carries a generated token (seconds).
Every failure — refused connection, timeout, HTTP error, a stream without usage — is an
`ReplayOutcome` with `error` set, never an exception: one bad request does not stop a replay.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What one request got. Tokens are counts; times are seconds from the request's send."""

    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0           # usage.prompt_tokens_details.cached_tokens
    device_cached_tokens: int = 0    # usage.kvledger: from the engine's own device prefix cache
    store_cached_tokens: int = 0     # usage.kvledger: from the block ledger (and state ledger)
    completion_tokens: int = 0
    hit_kind: str = ""
    engine: str | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0
    sent_at: float = 0.0             # seconds since the replay's start
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def completion_body(model: str, tokens: list[int], max_tokens: int, salt: str | None) -> dict:
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if salt:
        body["cache_salt"] = salt
    return body


def send(url: str, body: dict, index: int, *, api_key: str | None = None, timeout_s: float = 300.0,
         sent_at: float = 0.0) -> ReplayOutcome:
    """POST `body` to `url`/v1/completions and read the stream; never raises for a bad answer."""
    parts = urlsplit(url)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return ReplayOutcome(index, sent_at=sent_at, error=f"HTTP {resp.status}: {resp.read(300)!r}")
        return _read_stream(resp, t0, index, sent_at)
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError) as e:
        return ReplayOutcome(index, sent_at=sent_at, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, t0: float, index: int, sent_at: float) -> ReplayOutcome:
    ttft, usage, error = None, None, None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line[6:] == b"[DONE]":
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = str(chunk["error"].get("message", "error"))[:300]
        for choice in chunk.get("choices") or ():
            if choice.get("token_ids") and ttft is None:
                ttft = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    if error or ttft is None or usage is None:
        return ReplayOutcome(index, sent_at=sent_at, error=error or "the stream ended without tokens or usage")
    return outcome_of(usage, index, ttft, time.perf_counter() - t0, sent_at)


def outcome_of(usage: dict, index: int, ttft_s: float, latency_s: float, sent_at: float) -> ReplayOutcome:
    """An ReplayOutcome from a response's `usage` (OpenAI's fields plus kvledger's `usage.kvledger`)."""
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    details = usage.get("kvledger") or {}
    device = int(details.get("device_cached_tokens", 0))
    store = int(details.get("store_cached_tokens", cached - device))
    return ReplayOutcome(index, int(usage["prompt_tokens"]), cached, device, store, int(usage["completion_tokens"]),
                   str(details.get("hit_kind", "")), details.get("engine"), ttft_s, latency_s, sent_at)
