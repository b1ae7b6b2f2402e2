"""The routes of `kvledger serve` (FastAPI). Request models live in protocol.py, the shared state
in server_state.py, the request path in prepare.py (tokenize, limits, CHECK) and generate.py (engine →
responses); this module only wires them to HTTP.

    app = build_app(ServeConfig(...)); then util/http_server.Server (entrypoint/cli.py)

Every client mistake is a 4xx with OpenAI's error object (`errors.py`): malformed JSON and wrong
types (400), a missing or wrong key (401), a tenant's key on an operator endpoint (403), an
unknown model (404), a body not in within --body-timeout-s (408), an oversized body (413), too many
concurrent requests of one key (429). A client that hangs up ends its request: a stream is cancelled by
Starlette, a non-streamed request by `_while_connected`; either way the engine's stream is closed, which
aborts the request in the engine (embedded) or closes the leg's connection (cluster: the engine aborts it).

The operator endpoints (`/metrics`, `/dashboard/*`, `/whatif`, `/admin/public-prefixes`, `/admin/forget`) name
every namespace and show every tenant's last requests, change what all share, or forget a tenant on every node
(forget.py): with a key file they need an operator key (`auth.may_operate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvledger.entrypoint import dashboard, whatif_endpoint
from kvledger.entrypoint.activity import status_line
from kvledger.entrypoint.auth import Tenant, authenticate, may_operate
from kvledger.entrypoint.body_limit import BodyLimit
from kvledger.entrypoint.errors import ApiError, bad_request, forbidden, internal_error, too_many, unauthorized
from kvledger.entrypoint.generate import CLIENT_GONE, Outcome, chat_body, completion_body, record, run, sse
from kvledger.entrypoint.metrics import EXPOSITION_TYPE, exposition
from kvledger.entrypoint.prepare import Prepared, prepare
from kvledger.util.public_prefix import parse_items
from kvledger.entrypoint.forget import forget_tenant
from kvledger.entrypoint.protocol import (ChatCompletionRequest, CompletionRequest, DiffRequest, ErrorResponse,
                                          ForgetRequest, ModelCard, ModelList, PublicPrefixChange)
from kvledger.entrypoint.server_state import ServeConfig, ServerState

STATIC = Path(__file__).with_name("static")
log = logging.getLogger("kvledger.serve")
ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
          413: {"model": ErrorResponse}, 429: {"model": ErrorResponse}}
OPERATOR_ERRORS = {**ERRORS, 403: {"model": ErrorResponse}}
CLIENT_GONE_STATUS = 499              # nginx's "client closed request"; no client ever sees it


def build_app(config: ServeConfig, state: ServerState | None = None) -> FastAPI:
    """The ASGI app; the engine starts (model loaded) in the app's lifespan."""
    state = state or ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_engine()
        every = config.status_every_s
        status = asyncio.create_task(_log_status(state, every)) if every > 0 else None
        try:
            yield
        finally:
            if status is not None:
                status.cancel()
            await asyncio.to_thread(state.close)

    app = FastAPI(title="kvledger serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions on kvledger's shared, persistent KV cache.")
    app.state.kv = state
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s,
                       on_reject=state.metrics.error)
    _error_handlers(app, state)
    _api_routes(app)
    _operator_routes(app)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


async def _log_status(state: ServerState, every_s: float) -> None:
    """A status line every `every_s` seconds in which the server did something (`activity.status_line`)."""
    before = state.activity.totals
    while True:
        await asyncio.sleep(every_s)
        now = state.activity.totals
        line = status_line(now, before, every_s, sum(state.in_flight.values()))
        if line is not None:
            log.info(line)
        before = now


def _state(request: Request) -> ServerState:
    return request.app.state.kv


def authenticated(request: Request) -> Tenant:
    """The request's tenant (a dependency: it runs before the body is validated)."""
    state = _state(request)
    tenant = authenticate(state.keys, request.headers.get("authorization"))
    if tenant is None:
        raise unauthorized()
    return tenant


AuthTenant = Annotated[Tenant, Depends(authenticated)]


def operator(request: Request) -> Tenant:
    """The caller of an operator endpoint: 401 without a valid key, 403 for a key that is not an operator's
    (open servers: anyone)."""
    tenant = authenticated(request)
    if not may_operate(_state(request).keys, tenant):
        raise forbidden()
    return tenant


Operator = Annotated[Tenant, Depends(operator)]


def _admit(state: ServerState, tenant: Tenant) -> Callable[[], None]:
    """Count the request against its key's limit; the returned release runs once."""
    n = state.in_flight.get(tenant.label, 0)
    if n >= state.config.max_concurrent_per_key:
        raise too_many(state.config.max_concurrent_per_key)
    state.in_flight[tenant.label] = n + 1
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            state.in_flight[tenant.label] -= 1

    return release


async def _serve(request: Request, tenant: Tenant, body, endpoint: str) -> Response:
    state = _state(request)
    release = _admit(state, tenant)
    try:
        cache_control = ", ".join(request.headers.getlist("cache-control")) or None   # every such header counts
        prep = await prepare(state, tenant, body, endpoint, cache_control)
        if prep.stream:
            stream = sse(state, prep, release)
            release = _nothing  # the stream releases at its end
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = Outcome()
        if not await _while_connected(request, _complete(state, prep, out)):
            state.metrics.error(CLIENT_GONE)
            log.info("request %s: the client hung up; aborted", prep.request_id)
            return Response(status_code=CLIENT_GONE_STATUS)   # nobody reads it
        record(state, prep, out)
        return JSONResponse(chat_body(state, prep, out) if endpoint == "chat" else completion_body(state, prep, out))
    finally:
        release()


async def _complete(state: ServerState, prep: Prepared, out: Outcome) -> None:
    async for _ in run(state, prep, out):
        pass


async def _while_connected(request: Request, work: Coroutine[Any, Any, None]) -> bool:
    """Run `work` to its end (True; its exception, if any, is raised), or until the client hangs up (False):
    then `work` is cancelled before this returns, so nothing of it runs on for nobody."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True


async def _hung_up(request: Request) -> None:
    """Returns when the client disconnects. The body was read (validated) before: what the server receives
    after it is `http.disconnect`, sent when the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _nothing() -> None:
    return None


def _api_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", responses=ERRORS, tags=["openai"])
    async def completions(request: Request, body: CompletionRequest,
                          tenant: AuthTenant) -> Response:
        return await _serve(request, tenant, body, "completion")

    @app.post("/v1/chat/completions", responses=ERRORS, tags=["openai"])
    async def chat_completions(request: Request, body: ChatCompletionRequest,
                               tenant: AuthTenant) -> Response:
        return await _serve(request, tenant, body, "chat")

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS, tags=["openai"])
    async def models(request: Request, tenant: AuthTenant) -> ModelList:
        state = _state(request)
        return ModelList(data=[ModelCard(id=state.model, created=state.created, max_model_len=state.max_model_len)])

    @app.get("/v1/cache/misses", responses=ERRORS, tags=["kvledger"])
    async def cache_misses(request: Request, tenant: AuthTenant) -> JSONResponse:
        """Why prompts missed: per tenant, prompt and miss tokens by cause and the top divergence sites. A
        tenant's key sees its own tenant only (every namespace its cache salts make); an operator sees all."""
        state = _state(request)
        everyone = may_operate(state.keys, tenant)
        return JSONResponse({"object": "list", "data": state.misses.report(None if everyone else tenant.namespace)})

    @app.get("/health", tags=["operator"])
    async def health(request: Request) -> JSONResponse:
        state = _state(request)
        alive = state.engine is not None and state.engine.alive
        engines = state.engine.engine_count if alive else 0   # cluster mode: those it routes to
        return JSONResponse({"status": "ok" if alive else "engine down", "model": state.model,
                             "engines": engines}, status_code=200 if alive else 503)


def _operator_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/metrics", responses=OPERATOR_ERRORS, tags=["operator"])
    async def metrics(request: Request, _: Operator) -> Response:
        registry = _state(request).metrics.registry
        return Response(await asyncio.to_thread(exposition, registry), media_type=EXPOSITION_TYPE)

    @app.get("/dashboard/activity", responses=OPERATOR_ERRORS, tags=["operator"])
    async def activity(request: Request, _: Operator) -> JSONResponse:
        return JSONResponse(dashboard.activity(_state(request)))

    @app.post("/dashboard/diff", responses=OPERATOR_ERRORS, tags=["operator"])
    async def diff(request: Request, body: DiffRequest, _: Operator) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(dashboard.diff, _state(request), body))

    @app.get("/admin/public-prefixes", responses=OPERATOR_ERRORS, tags=["operator"])
    async def public_prefixes(request: Request, _: Operator) -> JSONResponse:
        """The published public prefixes: each one's length and a digest of its tokens."""
        return JSONResponse({"prefixes": _state(request).public.describe()})

    @app.post("/admin/public-prefixes", responses=OPERATOR_ERRORS, tags=["operator"])
    async def change_public_prefixes(request: Request, body: PublicPrefixChange, _: Operator) -> JSONResponse:
        """Publish `add` and withdraw `remove` (rule 12); only an operator key may (a tenant's: 403)."""
        state = _state(request)
        try:
            tokenize = state.tokenize if state.tokenizer is not None else None
            added = parse_items(body.add, tokenize, state.vocab_size or None) if body.add else []
            removed = parse_items(body.remove, tokenize, state.vocab_size or None) if body.remove else []
            public = state.public.with_added(added)
            public, withdrawn = public.without(removed)
        except ValueError as e:
            raise bad_request(str(e), "add" if body.add else "remove", "invalid_value") from None
        state.public = public
        log.info("public prefixes: %d published, %d withdrawn; %d now", len(added), withdrawn, len(public.prefixes))
        return JSONResponse({"prefixes": public.describe(), "withdrawn": withdrawn})

    @app.post("/admin/forget", responses=OPERATOR_ERRORS, tags=["operator"])
    async def forget(request: Request, body: ForgetRequest, _: Operator) -> JSONResponse:
        """Forget a tenant (DESIGN rule 12): its blocks, snapshots, tombstones, miss sample and trace lines, on every
        node; the receipt counts what was removed where (forget.py)."""
        from kvledger.store.forget import DEFAULT_HOLD_S, check_hold, check_tenant

        hold_s = DEFAULT_HOLD_S if body.hold_s is None else body.hold_s
        for param, check, value in (("namespace", check_tenant, body.namespace), ("hold_s", check_hold, hold_s)):
            try:
                check(value)
            except ValueError as e:
                raise bad_request(str(e), param, "invalid_value") from None
        return JSONResponse(await forget_tenant(_state(request), body.namespace, float(hold_s)))

    @app.get("/whatif", responses=OPERATOR_ERRORS, tags=["operator"])
    async def whatif(request: Request, _: Operator) -> JSONResponse:
        """`kvledger whatif` on this server's own trace (query: capacity, ttl, routing, last, prefill_engines)."""
        return JSONResponse(await whatif_endpoint.answer(_state(request), request.query_params.multi_items()))


def _error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        state.metrics.error(e.kind)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return await api_error(request, ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        state.metrics.error("internal")
        log.error("internal error on %s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return internal_error().response()


def _validation_error(e: RequestValidationError) -> ApiError:
    """The first validation error as one readable line; `param` is the field's path."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"The body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "missing" and not loc:
        return bad_request("The request needs a JSON body.", code="invalid_json")
    msg = first.get("msg", "invalid value")
    return bad_request(f"{param}: {msg}" if param else msg, param, code="invalid_value")
