"""`kvledger engine`: one engine as its own process in the cluster mode (DESIGN.md "Layout").

It opens the cluster's shared parts — the block ledger in its cluster mode (Redis index, segment
files under `<data_dir>/blocks`, the shared mount) and, for models with sliding-window layers, the
state ledger (its own slot pool and state server, the Redis directory) — loads the model, serves
the internal API of `wire.py` behind the cluster token, and heartbeats its `EngineInfo` into the
registry.

Shutdown (SIGTERM or SIGINT): the engine marks itself draining at once (no new request reaches
it), hands every request it runs back to the entrypoint with its KV stored (finish_reason
"handoff"; the entrypoint continues each on another engine), then waits up to `grace_s` for its
streams to end before it exits and leaves the registry. A signal during the model load abandons
the load at once (`StartupInterrupted`): there is nothing to drain yet, and no reason to wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvledger.core import chain_parent, tail_key, tail_parts, takes_tail, with_tail
from kvledger.engine.api import EngineRequest
from kvledger.engine.async_engine import AsyncEngine
from kvledger.engine.client import EngineFailed, EngineRejected
from kvledger.engine.defaults import DEFAULTS
from kvledger.engine.engine_registry import DEFAULT_TTL_S, EngineInfo, Heartbeat, Registry
from kvledger.engine.session import H_MAC, H_SEQ, H_SESSION, SESSION_PATH, ProofFailed, SessionClient, SessionTable
from kvledger.engine.wire import FORGET_PATH, KEEPALIVE_S, ForgetBody, GenerateBody, WireEvent
from kvledger.state.auth import derive_keys
from kvledger.store.quota import Quotas

log = logging.getLogger("kvledger.cluster")
WAIT_STORED_S = 10.0   # a prefill leg's end waits this long at most for its blocks to be on the block ledger
TAIL_PATH = "/engine/v1/tail/"
TAIL_PULL_S = 2.0      # a decode leg waits this long at most for its tail; then it recomputes it


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    role: str
    redis_url: str
    token: str
    data_dir: Path
    engine_id: str
    host: str = DEFAULTS.host
    max_num_seqs: int = DEFAULTS.max_num_seqs
    device: str = DEFAULTS.device
    replay: bool = False
    checkpoint_every: int = DEFAULTS.checkpoint_every   # rule 4′: a snapshot every this many prompt tokens (0: none)
    stream_hits: bool | None = None   # `Engine(stream_hits=...)`; None: the engine's default
    grace_s: float = DEFAULTS.engine_grace_s
    heartbeat_ttl_s: float = DEFAULT_TTL_S
    store_capacity_bytes: int | None = None   # the shared block ledger's limit: this engine's puts evict past it
    quotas: Quotas | None = None              # the guarantees its evictions keep (None: those the store records)


class StartupInterrupted(BaseException):
    """A stop signal arrived while the model loaded: raised into the load (from the signal handler, on the
    main thread that loads), so the engine stops without finishing it. A BaseException: no `except
    Exception` inside a loader swallows it."""


class EngineProcess:
    """Ledgers, engine, heartbeat and in-flight accounting of one engine process."""

    def __init__(self, config: EngineConfig) -> None:
        from kvledger.engine.ledgers import Part, open_ledgers
        from kvledger.engine.models.registry import resolve

        self.config = config
        self.entry = resolve(config.model)   # a name or a path; served (and registered) as `entry.name`
        self.spec = self.entry.spec
        self.ledgers = open_ledgers(self.spec, config.data_dir, Part.ENGINE, redis_url=config.redis_url,
                                    token=config.token, engine_id=config.engine_id, host=config.host,
                                    capacity_bytes=config.store_capacity_bytes, quotas=config.quotas)
        self.block_ledger, self.state_ledger = self.ledgers.block, self.ledgers.state
        self.registry = Registry.from_url(config.redis_url, derive_keys(config.token).registry,
                                          ttl_s=config.heartbeat_ttl_s)
        self.engine: AsyncEngine | None = None
        self.heartbeat: Heartbeat | None = None
        self.url = ""
        self.draining = False
        self.loading = False     # inside `start`: a stop signal raises StartupInterrupted there
        self.abandoned = False   # a stop signal came before the start finished: it does not (go on)
        self.prefill_left: dict[str, int] = {}   # request id → prompt tokens not yet computed
        self.tail_sessions = SessionClient(config.token)   # this engine calling others (a P/D tail)
        self.tail_client: httpx.AsyncClient | None = None
        self.tail_pulls: dict[str, int] = {}     # outcome → pulls (a decode leg's tail: took, absent, failed)

    def start(self, url: str) -> None:
        """Load the model (seconds), start the step loop, then register (from the event loop)."""
        from kvledger.engine.engine import Engine

        self.loading = True
        try:
            if self.abandoned:   # the signal came after uvicorn took the signals, before the load began
                raise StartupInterrupted
            self.engine = AsyncEngine(Engine(self.entry, block_ledger=self.block_ledger,
                                             state_ledger=self.state_ledger, device=self.config.device,
                                             max_num_seqs=self.config.max_num_seqs, replay=self.config.replay,
                                             checkpoint_every=self.config.checkpoint_every,
                                             stream_hits=self.config.stream_hits))
            engine = self.engine.engine
            self.info0 = EngineInfo(self.config.engine_id, self.config.role, url, self.entry.name,
                                    engine.max_model_len, int(engine.model.vocab_size), tuple(engine.eos_token_ids),
                                    os.getpid())
            self.url = url
            self.engine.start(asyncio.get_running_loop())
            self.heartbeat = Heartbeat(self.registry, self.info, self.block_ledger.read_fault).start()
        finally:
            self.loading = False

    def info(self) -> EngineInfo:
        running = self.engine.running if self.engine is not None else 0
        return replace(self.info0, draining=self.draining, running=running,
                       queued_prefill_tokens=sum(self.prefill_left.values()))

    def on_stop_signal(self) -> None:
        """The first SIGTERM/SIGINT (in the signal handler, on the main thread). Before `start` has finished,
        the start is abandoned: not begun, or the load interrupted (StartupInterrupted); after it, drain."""
        if self.heartbeat is None:
            self.abandoned = True
            if self.loading:
                raise StartupInterrupted
            return
        self.drain()

    def drain(self) -> None:
        """Stop taking requests and hand the running ones back (their KV stored)."""
        if self.draining:
            return
        self.draining = True
        if self.heartbeat is not None:
            self.heartbeat.beat()
        if self.engine is not None:
            self.engine.hand_off_all()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.engine is not None:
            self.engine.close()
        self.ledgers.close()

    async def pull_tail(self, body: GenerateBody, req: EngineRequest) -> EngineRequest:
        """A P/D decode leg: `req` with the tail its prefill engine kept (`body.tail_from`) and the decision
        raised to compute one token (`core.with_tail`), or `req` as it came when the tail is absent, late
        (TAIL_PULL_S), unproven or of the wrong size: then the leg recomputes the tail (rule 8)."""
        if body.tail_from is None or not takes_tail(self.spec):
            return req
        b, last = self.spec.block_size, len(body.tokens) - 1
        whole = last // b
        held = req.decision.block_hit_tokens // b
        if held < whole and self.spec.has_swa:   # a windowed L1 stops at a snapshot: ask the index (metadata)
            held = await asyncio.to_thread(self.block_ledger.match, req.keys[:whole], namespace=req.namespace,
                                           ttl_class=req.ttl_class)
        raised = with_tail(req.decision, len(body.tokens), self.spec, held)
        if raised is None:
            return req
        parent = chain_parent(self.spec, req.namespace, req.keys[:whole], public_blocks=req.public_blocks)
        path = TAIL_PATH + tail_key(parent, body.tokens[whole * b:last]).hex()
        url, outcome, kv = body.tail_from, "failed", None
        try:
            async with asyncio.timeout(TAIL_PULL_S):
                if self.tail_client is None:
                    self.tail_client = httpx.AsyncClient(timeout=TAIL_PULL_S)
                sent = await self.tail_sessions.headers(self.tail_client, url, "GET", path, b"")
                r = await self.tail_client.get(url + path, headers=sent)
            if r.status_code == 401:
                self.tail_sessions.forget(url)
            if r.status_code == 404:
                outcome = "absent"
            elif (r.status_code == 200 and len(r.content) == sum(tail_parts(len(body.tokens), self.spec))
                  and self.tail_sessions.reply_ok(url, sent, path, r.content, r.headers.get(H_MAC))):
                outcome, kv = "took", r.content
        except (TimeoutError, httpx.HTTPError, ProofFailed) as e:
            log.warning("%s: no tail from %s (%s: %s); this leg recomputes it", req.request_id, url[:200],
                        type(e).__name__, e)
        self.tail_pulls[outcome] = self.tail_pulls.get(outcome, 0) + 1
        return req if kv is None else replace(req, decision=raised, tail_kv=kv)

    async def stream(self, body: GenerateBody, req: EngineRequest) -> AsyncIterator[bytes]:
        """The NDJSON lines of one leg: events, keepalives while computing, a last finished line."""
        assert self.engine is not None
        req = await self.pull_tail(body, req)
        self.prefill_left[req.request_id] = len(body.tokens) - req.decision.hit_tokens
        events = self.engine.generate(req)
        try:
            async for ev in _with_keepalive(events, KEEPALIVE_S):
                if ev is None:
                    yield b"\n"
                    continue
                self.prefill_left.pop(req.request_id, None)
                wire = WireEvent.of(ev, self.config.engine_id)
                if ev.finished and (body.wait_stored or ev.finish_reason == "handoff"):
                    if wire.token_ids:   # the client gets the token now; the end once the KV is stored
                        yield wire.model_copy(update={"finished": False, "finish_reason": None}).line()
                        wire = wire.model_copy(update={"token_ids": []})
                    async for _ in _with_keepalive(self._stored(req.request_id), KEEPALIVE_S):
                        yield b"\n"
                yield wire.line()
        except EngineRejected as e:
            yield WireEvent(finished=True, finish_reason="abort", error=f"rejected: {e}").line()
        except EngineFailed as e:
            yield WireEvent(finished=True, finish_reason="abort", error=f"failed: {e}").line()
        finally:
            self.prefill_left.pop(req.request_id, None)
            await events.aclose()


    async def _stored(self, request_id: str) -> AsyncIterator[None]:
        """Ends once the writes queued so far are on the ledgers, or after WAIT_STORED_S: a slow or stuck store
        (a dead client's lock on a shared mount, a full volume) costs the next leg a recompute, never the
        request (rule 8). Yields nothing: `_with_keepalive` around it keeps the stream alive meanwhile."""
        assert self.engine is not None
        if not await asyncio.to_thread(self.engine.engine.wait_stored, WAIT_STORED_S):
            log.warning("%s: its blocks were not stored within %.0f s; the next leg recomputes what is missing",
                        request_id, WAIT_STORED_S)
        return
        yield


async def _with_keepalive(events: AsyncIterator[Any], interval_s: float) -> AsyncIterator[Any]:
    """The items of `events`, with None whenever `interval_s` passes without one."""
    it = events.__aiter__()
    next_item: asyncio.Task | None = None
    try:
        while True:
            if next_item is None:
                next_item = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({next_item}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = next_item.result()
            except StopAsyncIteration:
                return
            finally:
                next_item = None
            yield item
    finally:
        if next_item is not None:
            next_item.cancel()


def build_engine_app(proc: EngineProcess, url: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            proc.start(url)   # the model loads here (seconds); then the engine registers
        except StartupInterrupted:   # uvicorn already means to exit: it starts nothing and shuts down at once
            print(f"kvledger engine: {proc.config.engine_id} stopped while loading", flush=True)
        else:
            print(f"kvledger engine: {proc.config.engine_id} ({proc.config.role}, {proc.config.model}, "
                  f"{torch.get_num_threads()} torch threads, {proc.engine.engine.hits_mode}) ready at {url}",
                  flush=True)
        try:
            yield
        finally:
            if proc.tail_client is not None:
                await proc.tail_client.aclose()
            await asyncio.to_thread(proc.close)

    app = FastAPI(title="kvledger engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    sessions = SessionTable(proc.config.token)

    @app.middleware("http")
    async def authenticated(request: Request, call_next):
        """Every path but the session's needs a request MAC of a live session (engine/session.py)."""
        if request.url.path != SESSION_PATH:
            h = request.headers
            why = sessions.check(h.get(H_SESSION), h.get(H_SEQ), h.get(H_MAC), request.method, request.url.path,
                                 await request.body())
            if why is not None:
                code = "session_unknown" if why == "session_unknown" else "unauthenticated"
                return JSONResponse({"error": {"message": why, "type": "authentication_error", "code": code}},
                                    status_code=401)
        return await call_next(request)

    @app.post(SESSION_PATH)
    async def open_session(request: Request) -> JSONResponse:
        try:
            return JSONResponse(sessions.open(str((await request.json())["client_nonce"])))
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": {"message": "send {\"client_nonce\": 64 hex digits}",
                                           "type": "invalid_request_error"}}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = (e.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse({"error": {"message": f"{where}: {first.get('msg', 'invalid')}",
                                       "type": "invalid_request_error"}}, status_code=400)

    @app.post("/engine/v1/generate")
    async def generate(body: GenerateBody) -> Any:
        if proc.draining:
            return JSONResponse({"error": {"message": "draining", "type": "unavailable"}}, status_code=503)
        try:
            info = proc.info0   # a ValueError is the caller's mistake
            req = body.engine_request(proc.spec, vocab_size=info.vocab_size, max_model_len=info.max_model_len)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400)
        return StreamingResponse(proc.stream(body, req), media_type="application/x-ndjson")

    @app.post(FORGET_PATH)
    async def forget(body: ForgetBody) -> JSONResponse:
        """Forget a tenant on this engine (`Engine.forget`): what it dropped, by kind."""
        if proc.engine is None:
            return JSONResponse({"error": {"message": "not started", "type": "unavailable"}}, status_code=503)
        return JSONResponse((await proc.engine.forget(body.tenant))["embedded"])

    @app.get(TAIL_PATH + "{key}")
    async def tail(key: str, request: Request) -> Response:
        """A P/D tail this engine kept, taken (engine/tails.py), with its reply MAC (engine/session.py)."""
        kv = None
        if len(key) == 32 and all(c in "0123456789abcdef" for c in key) and proc.engine is not None:
            kv = proc.engine.engine.tails.take(bytes.fromhex(key))
        if kv is None:
            return JSONResponse({"error": {"message": "no such tail", "type": "not_found"}}, status_code=404)
        h = request.headers
        tag = sessions.reply_mac(h[H_SESSION], int(h[H_SEQ]), request.url.path, kv)
        if tag is None:
            return JSONResponse({"error": {"message": "session_unknown", "type": "authentication_error"}},
                                status_code=401)
        return Response(memoryview(kv), media_type="application/octet-stream", headers={H_MAC: tag})

    @app.get("/engine/v1/health")
    async def health() -> JSONResponse:
        alive = proc.engine is not None and proc.engine.alive
        info = proc.info() if proc.engine is not None else None
        fault = proc.heartbeat.fault_reason if proc.heartbeat is not None else None
        status = "down" if not alive else "unhealthy" if fault else "ok"
        return JSONResponse({"status": status, "engine": proc.config.engine_id, "role": proc.config.role,
                             "draining": proc.draining, "fault": fault, "running": info.running if info else 0,
                             "time": time.time()}, status_code=200 if status == "ok" else 503)

    return app
