"""Running a prepared request: engine events → text, OpenAI responses and SSE chunks, metrics.

Streaming follows OpenAI: `data: {chunk}\\n\\n` per delta, the last content chunk carries
`finish_reason`, then (with `stream_options.include_usage`) one chunk with empty `choices` and
the `usage`, then `data: [DONE]\\n\\n`. An engine failure in the middle of a stream is sent as
`data: {"error": ...}` before `[DONE]` (the status line has already gone out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvledger.core import tenant_of
from kvledger.core.attribution import MissCause, MissSplit, split_misses
from kvledger.engine.api import RequestUsage, TokenEvent
from kvledger.entrypoint.activity import RequestRecord
from kvledger.engine.client import EngineFailed, EngineRejected
from kvledger.entrypoint.detokenize import TextStream
from kvledger.entrypoint.errors import ApiError, engine_error
from kvledger.entrypoint.misses import FirstAbsent
from kvledger.entrypoint.prepare import Prepared
from kvledger.entrypoint.protocol import LegDetails, Usage
from kvledger.entrypoint.server_state import ServerState
from kvledger.entrypoint.trace_recorder import trace_request

log = logging.getLogger("kvledger.serve")
CLIENT_GONE = "client_disconnected"   # the error kind counted for a request whose client hung up


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass(slots=True)
class Outcome:
    """What a finished request reports. Times are time.perf_counter() seconds."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: RequestUsage | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    miss: dict[str, Any] | None = None   # usage.kvledger.miss, when the request asked (explain_cache_miss)
    first_absent: FirstAbsent | None = None   # the first absent block under the cap, and why (at the end)
    kept: bool = True   # what of it stays (sample, trace; its blocks did): a storing request whose tenant was not
                        # forgotten while it ran (`Forgetting.keeps`)


async def run(state: ServerState, prep: Prepared, out: Outcome) -> AsyncIterator[Delta]:
    """Deltas of text until the request ends; `out` holds the totals when the iterator is done."""
    assert state.engine is not None
    decode = state.tokenizer.decode if state.tokenizer is not None else None
    text = TextStream(decode, prep.stop)
    state.metrics.running.inc()
    try:
        async for ev in until_stopped(state.engine.generate(prep.engine_request), state.stopping):
            if ev.usage is not None:
                out.usage = ev.usage
            if ev.token_ids:
                _tick(state, out)
                out.token_ids.extend(ev.token_ids)
            delta = text.push(ev.token_ids)
            if text.stopped:
                out.finish_reason = "stop"
                yield Delta(delta, list(ev.token_ids))
                break
            if ev.finished:
                out.finish_reason = ev.finish_reason
                delta += text.finish()
            if delta or ev.token_ids or ev.finished:
                yield Delta(delta, list(ev.token_ids), None)
            if ev.finished:
                break
    except EngineRejected as e:
        raise ApiError(400, str(e), code="engine_rejected") from None
    except EngineFailed as e:
        log.error("request %s failed in the engine: %s", prep.request_id, e)
        raise engine_error() from None
    finally:
        state.metrics.running.dec()
    out.text = text.text
    out.kept = prep.stores and state.forgetting.keeps(prep.engine_request.namespace, prep.arrival)
    out.first_absent = first_absent(state, prep)
    if prep.explain_miss:
        split = miss_split(prep, usage_of(prep, out).prompt_cache_hit_tokens, out.first_absent)
        out.miss = state.misses.explain(split, out.first_absent, prep.engine_request.tokens)


def first_absent(state: ServerState, prep: Prepared) -> FirstAbsent | None:
    """The first block under the cap the CHECK did not find, and why (entrypoint/misses.py: its tombstone, else
    the namespace's sample); None when every block up to the cap was there, or under --no-cache."""
    found, d, req = prep.found, prep.decision, prep.engine_request
    if found is None or found.blocks * state.spec.block_size >= max(d.cap, 0):
        return None
    return state.misses.first_absent(req.namespace, req.tokens, req.keys, found.blocks, found.gone)


def miss_split(prep: Prepared, cached: int, first: FirstAbsent | None) -> MissSplit:
    """The request's miss tokens by cause (core.attribution), from its CHECK and the `cached` tokens the engine
    really reused."""
    d = prep.decision
    l1 = max(d.cap, 0) if first is None else first.start   # L1: the blocks present, up to the cap
    if first is None:
        return split_misses(prep.prompt_tokens, d, l1, cached, MissCause.COLD)
    return split_misses(prep.prompt_tokens, d, l1, cached, first.cause, first.divergence, first.diverged_block)


async def until_stopped(events: AsyncIterator[TokenEvent], stopping: asyncio.Event | None
                        ) -> AsyncIterator[TokenEvent]:
    """The engine's events, until the server stops (Ctrl-C, or the end of a drain): then ApiError 503,
    and the engine's stream is closed, which aborts the request in the engine."""
    if stopping is None:   # an app whose engine was started without a loop of ours (tests)
        async for ev in events:
            yield ev
        return
    stop = asyncio.ensure_future(stopping.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait((step, stop), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ApiError(503, "The server is shutting down; the request was not finished.",
                               "server_error", code="server_shutting_down")
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        stop.cancel()
        # in a task of its own: a stream whose client hung up is unwound under Starlette's cancel scope, which
        # cancels every await here too, and a close cut short would leave the engine generating for nobody
        await asyncio.shield(asyncio.ensure_future(_close(events, step)))


async def _close(events: AsyncIterator[TokenEvent], step: asyncio.Future | None) -> None:
    """Close the engine's stream, which aborts the request in the engine (a cluster leg: its connection)."""
    if step is not None and not step.done():   # the generator runs inside `step` until it is cancelled
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await step
    await events.aclose()


def _tick(state: ServerState, out: Outcome) -> None:
    now = time.perf_counter()
    if out.first_token_at is None:
        out.first_token_at = now
    elif out.last_token_at is not None:
        state.metrics.itl.observe(now - out.last_token_at)
    out.last_token_at = now


def usage_of(prep: Prepared, out: Outcome) -> Usage:
    u = out.usage
    if u is None:
        return Usage.of(prep.prompt_tokens, 0, len(out.token_ids), stored=out.kept)
    cached = min(u.cached_tokens, prep.prompt_tokens)
    legs = [LegDetails(kind=leg.kind, engine=leg.engine, start=leg.start, cached_tokens=leg.cached_tokens,
                       computed_prompt_tokens=leg.computed_prompt_tokens) for leg in u.legs] or None
    return Usage.of(prep.prompt_tokens, cached, len(out.token_ids), hit_kind=u.hit_kind,
                    device_cached=min(u.device_cached_tokens, cached), computed=u.computed_prompt_tokens,
                    engine=u.engine, legs=legs, miss=out.miss, stored=out.kept)


def usage_json(prep: Prepared, out: Outcome) -> dict[str, Any]:
    """The response's usage object: `kvledger.miss` only when asked for, `kvledger.stored` (false) only on a no-store
    request (the default response is unchanged)."""
    usage = usage_of(prep, out).model_dump()
    details = usage["kvledger"]
    for name in ("miss", "stored"):
        if details is not None and details[name] is None:
            del details[name]
    return usage


def record(state: ServerState, prep: Prepared, out: Outcome) -> None:
    """Metrics and the page's activity for one finished request."""
    m, ns = state.metrics, tenant_of(prep.engine_request.namespace)
    usage = usage_of(prep, out)
    cached = usage.prompt_cache_hit_tokens
    kind = out.usage.hit_kind if out.usage is not None else ("miss" if cached == 0 else "unknown")
    m.requests.labels(ns, kind).inc()
    m.prompt_tokens.labels(ns).inc(usage.prompt_tokens)
    m.hit_tokens.labels(ns, kind).inc(cached)
    m.miss_tokens.labels(ns, kind).inc(usage.prompt_cache_miss_tokens)
    m.generation_tokens.labels(ns).inc(usage.completion_tokens)
    if out.usage is not None:
        m.preemptions.inc(out.usage.preemptions)
    ttft = None if out.first_token_at is None else out.first_token_at - prep.arrival
    if ttft is not None:
        m.ttft.labels("hit" if cached > 0 else "cold").observe(ttft)
    _record_fetch(state, prep, out, cached)
    _record_misses(state, prep, out, cached)
    state.activity.record(RequestRecord(time.time(), prep.request_id, ns, prep.endpoint, usage.prompt_tokens,
                                        cached, usage.completion_tokens, kind, ttft, out.finish_reason))
    if out.kept:   # a no-store request leaves no trace line (rule 12); counts and metrics keep no token of it
        trace_request(state, prep, out, usage, ttft)


def _record_misses(state: ServerState, prep: Prepared, out: Outcome, cached: int) -> None:
    """Miss tokens by cause (`kvledger_prompt_miss_tokens_total`), the tenant's causes and divergence sites, and
    the prompt into its namespace's sample (after its own lookup: a prompt never explains itself). A no-store
    request is counted in the metrics only: its tenant's sites would keep a span of its text, and its sample the
    prompt (rule 12)."""
    if state.config.no_cache:
        return
    req = prep.engine_request
    split = miss_split(prep, cached, out.first_absent)
    tenant = tenant_of(req.namespace)
    for cause, n in split.tokens.items():
        state.metrics.prompt_miss_tokens.labels(tenant, str(cause)).inc(n)
    if out.kept:
        state.misses.account(req.namespace, split, out.first_absent, req.tokens)
        state.misses.add(req.namespace, req.tokens, req.keys)


def _record_fetch(state: ServerState, prep: Prepared, out: Outcome, cached: int) -> None:
    m, block = state.metrics, state.spec.block_size
    if prep.absent_blocks:
        m.miss_blocks.labels("absent").inc(prep.absent_blocks)
    lost = prep.decision.hit_tokens - cached
    if lost > 0:
        m.miss_blocks.labels("load_failed").inc(-(-lost // block))
    if out.usage is None:
        return
    # only what the fetcher really read: a device-cache hit reads nothing from the store
    m.fetch_bytes.inc(out.usage.fetch_bytes)
    if "fetch_s" in out.usage.timings:
        m.fetch_seconds.observe(out.usage.timings["fetch_s"])
    m.fetcher_misses(out.usage.fetch_misses)


# --- response bodies ---------------------------------------------------------------------


def completion_body(state: ServerState, prep: Prepared, out: Outcome) -> dict:
    return {"id": prep.request_id, "object": "text_completion", "created": int(time.time()), "model": state.model,
            "choices": [{"index": 0, "text": out.text, "token_ids": out.token_ids, "logprobs": None,
                         "finish_reason": out.finish_reason}],
            "usage": usage_json(prep, out)}


def chat_body(state: ServerState, prep: Prepared, out: Outcome) -> dict:
    return {"id": prep.request_id, "object": "chat.completion", "created": int(time.time()), "model": state.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                         "finish_reason": out.finish_reason}],
            "usage": usage_json(prep, out)}


async def sse(state: ServerState, prep: Prepared, release) -> AsyncIterator[str]:
    """The SSE stream of one request; `release()` runs once at its end, however it ends."""
    out, created = Outcome(), int(time.time())
    chat = prep.endpoint == "chat"
    head = {"id": prep.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": state.model}
    extra = {"usage": None} if prep.include_usage else {}
    try:
        if chat:
            yield _data(head | {"choices": [_chat_choice({"role": "assistant", "content": ""}, None)]} | extra)
        async for d in run(state, prep, out):
            choice = (_chat_choice({"content": d.text} if d.text else {}, None) if chat
                      else {"index": 0, "text": d.text, "token_ids": d.token_ids, "logprobs": None,
                            "finish_reason": None})
            if d.text or d.token_ids:
                yield _data(head | {"choices": [choice]} | extra)
        final = (_chat_choice({}, out.finish_reason) if chat else
                 {"index": 0, "text": "", "token_ids": [], "logprobs": None, "finish_reason": out.finish_reason})
        yield _data(head | {"choices": [final]} | extra)
        if prep.include_usage:
            yield _data(head | {"choices": [], "usage": usage_json(prep, out)})
        record(state, prep, out)
    except ApiError as e:
        state.metrics.error(e.kind)
        yield _data(e.body())
    except asyncio.CancelledError:   # the client hung up: Starlette cancels the stream, `run` closes the engine's
        state.metrics.error(CLIENT_GONE)
        raise
    finally:
        release()
    yield "data: [DONE]\n\n"


def _chat_choice(delta: dict, finish_reason: str | None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
