"""The cluster's engines behind the entrypoint: routing, prefill/decode legs, hand-off and retry.

`RemoteEngines` is the cross-process `EngineClient` (engine/client.py): its `generate(req)` yields the
same `TokenEvent`s as the embedded `AsyncEngine`, so the HTTP side (generate.py) is one code path for
both modes. A request runs as one or more *legs*,
each one `POST /engine/v1/generate` on one engine (wire.py):

| leg      | engine                        | tokens sent            | max_tokens    | then                  |
|----------|-------------------------------|------------------------|---------------|-----------------------|
| whole    | prefill-capable (router)      | prompt                 | the request's | done                  |
| prefill  | prefill engine (router), P/D  | prompt                 | 1             | decode leg            |
| decode   | decode engine (least loaded)  | prompt + output so far | what is left  | done                  |
| continue | another engine, after a       | prompt + output so far | what is left  | as the leg it replaces|
|          | hand-off, a death or a failure|                        |               |                       |

A no-store request (`EngineRequest.store` False, DESIGN rule 12) runs whole: P/D hands the prompt over through
the block ledger, which such a request may not write; a continuation after a hand-off or a failure recomputes
what it cannot read.

Every leg after the first is CHECKed again (rule 5) on prompt + output: the blocks the previous
leg stored hit, and only the tail is recomputed (less than one block for full-attention models;
at most R + B tokens for windowed ones). A decode leg after a prefill leg recomputes not even that
(`core.takes_tail`: full attention and Gemma 3, not V4): the prefill engine keeps the prompt's partial last
block and its windows at the prompt's end (`keep_tail`, `core.tail_parts`) and the decode engine pulls them
from there (`tail_from`, engine/process.py), so it computes one token; a tail it cannot get is recomputed.
The client sees one stream: tokens are passed on as they come, none is repeated (a continuation starts after
the last token the client got) and none is lost (greedy decoding continues exactly; a seeded request's n-th draw
depends on its seed and n alone, `engine/sampler.py`, so a leg draws what one engine would).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import httpx
import numpy as np

from kvledger.core import HitDecision, ModelSpec, takes_tail
from kvledger.engine.api import EngineRequest, Leg, RequestUsage, TokenEvent
from kvledger.engine.client import EngineFailed, EngineRejected
from kvledger.engine.engine_registry import EngineInfo, Registry
from kvledger.engine.session import ProofFailed, SessionClient
from kvledger.engine.wire import FORGET_PATH, KEEPALIVE_S, ForgetBody, GenerateBody, WireEvent
from kvledger.entrypoint.router import Load, PromptView, Router

log = logging.getLogger("kvledger.cluster")
# tokens, namespace, TTL class, the keys known so far, the request's own prompt length, its public prefix's blocks
# → keys, decision
CheckFn = Callable[[np.ndarray, str, "str | None", list[bytes], int, int], tuple[list[bytes], HitDecision]]
MAX_LEGS = 8
NO_ENGINE_WAIT_S = 15.0
SUSPECT_S = 5.0   # a broken stream keeps other requests off its engine this long (> the registry's TTL)
LEG_IDLE_S = 3 * KEEPALIVE_S   # a leg silent this long (no event, no keepalive) is broken: a frozen or hung
                               # engine; the request continues elsewhere
UNTRUSTED_S = 60.0   # an engine that failed the token proof gets no request this long (then it may try again)
GENERATE_PATH = "/engine/v1/generate"
FORGET_TIMEOUT_S = 60.0   # an engine's forget waits up to Engine.forget's FORGET_WAIT_S for its writer


class LegBroken(Exception):
    """A leg ended without its last event: the engine died, hung, drained or failed."""


class RemoteEngines:
    def __init__(self, registry: Registry, router: Router, token: str, check: CheckFn, spec: ModelSpec, *,
                 poll_s: float = 0.5, read_timeout_s: float = LEG_IDLE_S,
                 on_members: Callable[[list[EngineInfo]], None] | None = None,
                 on_leg: Callable[[str, str, RequestUsage | None], None] | None = None,
                 tail_handoff: bool = True) -> None:
        """`tail_handoff`: in P/D, the prefill engine keeps the prompt's partial last block and the decode engine
        pulls it, so the decode leg computes one token, not the tail (full-attention models; engine/tails.py)."""
        self.registry, self.router, self.check, self.spec = registry, router, check, spec
        self.tail_handoff = tail_handoff
        self.sessions = SessionClient(token)   # the token is never sent: each engine proves it first
        self.untrusted: dict[str, float] = {}  # engine id → monotonic time it failed the token proof
        self.disagreeing: set[str] = set()     # engine ids left out for serving other limits (logged once)
        self.poll_s = poll_s
        self.timeout = httpx.Timeout(connect=2.0, read=read_timeout_s, write=10.0, pool=5.0)
        self.on_members = on_members or (lambda members: None)   # each listing of the registry
        self.on_leg = on_leg or (lambda kind, engine_id, usage: None)   # at each leg's end
        self.engines: dict[str, EngineInfo] = {}
        self.loads: dict[str, Load] = {}
        self.suspect: dict[str, float] = {}    # engine id → monotonic time its stream broke
        self.client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task | None = None

    # --- lifetime -----------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=256))
        self._poller = loop.create_task(self._poll())

    def close(self, grace_s: float | None = None) -> bool:
        """From any thread but the loop's own (the server's lifespan runs it in a worker thread).
        True: closed within `grace_s` seconds (default 5)."""
        if self._loop is None or self._loop.is_closed():
            return True
        try:
            asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout=grace_s or 5)
        except Exception:
            return False
        return True

    async def _aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.client is not None:
            await self.client.aclose()

    @property
    def alive(self) -> bool:
        """At least one engine can take a prompt."""
        return any(e.prefills() for e in self.engines.values())

    @property
    def engine_count(self) -> int:
        return len(self.engines)

    async def _poll(self) -> None:
        while True:
            try:
                members = self._agreeing(await asyncio.to_thread(self.registry.members))
                self.engines = {e.engine_id: e for e in members}
                self.on_members(members)
            except Exception as e:  # noqa: BLE001 - the last view serves until Redis answers again
                log.warning("engine registry unreachable: %s", e)
            await asyncio.sleep(self.poll_s)

    async def refresh(self) -> None:
        self.engines = {e.engine_id: e for e in self._agreeing(await asyncio.to_thread(self.registry.members))}

    def _agreeing(self, members: list[EngineInfo]) -> list[EngineInfo]:
        """The members that serve the model as the first one (by id) does: same model, context, vocabulary and
        end tokens. One that differs is misconfigured: left out, and logged once."""
        if not members:
            return members
        limits = _limits(members[0])
        out = [e for e in members if _limits(e) == limits]
        for e in members:
            if _limits(e) != limits and e.engine_id not in self.disagreeing:
                self.disagreeing.add(e.engine_id)
                log.warning("engine %r left out: it serves %s, the others %s", e.engine_id[:64], _limits(e), limits)
        return out

    # --- a request ------------------------------------------------------------------

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenEvent]:
        prompt = [int(t) for t in np.asarray(req.tokens).tolist()]
        output: list[int] = []
        budget = req.sampling.max_tokens
        first: RequestUsage | None = None
        keys, decision, failed = req.keys, req.decision, set[str]()
        # P/D hands the prompt over through the block ledger; a no-store request stores nothing, so it runs whole
        phase = "prefill" if budget > 1 and req.store and self._disaggregated() else "whole"
        kind = phase   # what this leg is, for the metrics: whole | prefill | decode | continue
        legs: list[Leg] = []   # for the client's usage: where each leg began
        tail_from: str | None = None   # the prefill engine that kept the prompt's tail for the decode leg
        for leg in range(1, MAX_LEGS + 1):
            if leg > 1:   # the keys so far are kept: only the output's new blocks are hashed
                tokens = np.asarray(prompt + output, dtype=np.uint32)
                keys, decision = await asyncio.to_thread(self.check, tokens, req.namespace, req.ttl_class, keys,
                                                         len(prompt), req.public_blocks)
            left = budget - len(output)
            if left <= 0:   # every token arrived and the end did not (the engine died right after)
                yield TokenEvent(req.request_id, (), True, "length", self._usage(first, prompt, output, legs))
                return
            engine = await self._pick(phase, prompt + output, decision, req, failed)
            legs.append(Leg(kind, engine.engine_id, len(output)))
            sampling = replace(req.sampling, max_tokens=1 if phase == "prefill" else left)
            keep_tail = phase == "prefill" and self.tail_handoff and takes_tail(self.spec)
            body = GenerateBody.of(replace(req, request_id=f"{req.request_id}.{leg}", tokens=prompt + output,
                                           keys=keys, decision=decision, sampling=sampling, keep_tail=keep_tail,
                                           prompt_len=len(prompt)),
                                   wait_stored=phase == "prefill", tail_from=tail_from if kind == "decode" else None)
            reason, leg_usage = None, None
            events = self._leg(engine, body, decision.hit_tokens, leg == 1 and not output)
            try:
                async for ev in events:
                    leg_usage = ev.usage or leg_usage
                    if first is None and ev.usage is not None:
                        first = ev.usage
                    output.extend(ev.token_ids)
                    reason = ev.finish_reason if ev.finished else None
                    done = reason in ("stop", "length") and (phase != "prefill" or reason == "stop"
                                                             or len(output) >= budget)
                    if done:
                        self._leg_ended(legs, kind, engine, leg_usage)
                        yield TokenEvent(req.request_id, ev.token_ids, True, reason,
                                         self._usage(first, prompt, output, legs))
                        return
                    if ev.token_ids:
                        yield TokenEvent(req.request_id, ev.token_ids, False, None,
                                         first if len(output) == len(ev.token_ids) else None)
            except LegBroken as e:
                self.suspect[engine.engine_id] = time.monotonic()
                log.warning("leg %d of %s on %s broke (%s); continuing elsewhere", leg, req.request_id,
                            engine.engine_id, e)
            finally:
                await events.aclose()
            self._leg_ended(legs, kind, engine, leg_usage)
            if reason == "length" and phase == "prefill":
                phase = kind = "decode"
                tail_from = engine.url if keep_tail else None
            else:   # handed off, aborted or broken: continue on another engine
                failed.add(engine.engine_id)
                kind = "continue"
        raise EngineFailed(f"the request did not finish within {MAX_LEGS} engine legs")

    async def forget(self, tenant: str) -> dict[str, dict[str, int] | None]:
        """Forget `tenant` on every engine the registry lists, at once (`POST /engine/v1/forget`, each over its
        session): engine id → what it dropped, None for one that did not answer (or not one of this cluster's). An
        engine that was down has no pool and no device cache to bring back; what it wrote late the store's hold
        refuses (store/forget.py)."""
        engines = await asyncio.to_thread(self.registry.members)   # every one listed: misconfigured ones hold KV too
        answers = await asyncio.gather(*(self._forget_on(e, tenant) for e in engines))
        return {e.engine_id: got for e, got in zip(engines, answers)}

    async def _forget_on(self, engine: EngineInfo, tenant: str) -> dict[str, int] | None:
        assert self.client is not None
        content = ForgetBody(tenant=tenant).model_dump_json().encode()
        try:
            headers = await self.sessions.headers(self.client, engine.url, "POST", FORGET_PATH, content)
            r = await self.client.post(engine.url + FORGET_PATH, content=content, timeout=FORGET_TIMEOUT_S,
                                       headers={**headers, "Content-Type": "application/json"})
            if r.status_code == 401:
                self.sessions.forget(engine.url)
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}: {_message(r.content)}")
            got = r.json()
            return {str(k): int(v) for k, v in got.items()}
        except (httpx.HTTPError, ProofFailed, ValueError, TypeError, AttributeError) as e:
            log.warning("forget on engine %r failed: %s: %s", engine.engine_id[:64], type(e).__name__, e)
            return None

    def _leg_ended(self, legs: list[Leg], kind: str, engine: EngineInfo, usage: RequestUsage | None) -> None:
        """The last leg ended: the metrics, and its own counts on its record (the client's usage shows them)."""
        self.on_leg(kind, engine.engine_id, usage)
        if usage is not None:
            legs[-1] = replace(legs[-1], cached_tokens=usage.cached_tokens,
                               computed_prompt_tokens=usage.computed_prompt_tokens)

    def _usage(self, first: RequestUsage | None, prompt: list[int], output: list[int], legs: list[Leg]
               ) -> RequestUsage:
        """The client's usage: the prompt's hit as the first leg found it, the output of all legs, the legs."""
        if first is None:
            return RequestUsage(len(prompt), 0, len(output), "miss", None, legs=tuple(legs))
        return replace(first, prompt_tokens=len(prompt), completion_tokens=len(output), legs=tuple(legs))

    def _disaggregated(self) -> bool:
        live = [e for e in self.engines.values() if not e.draining]
        return any(e.role == "decode" for e in live) and any(e.role == "prefill" for e in live)

    def _candidates(self, phase: str, failed: set[str]) -> list[EngineInfo]:
        """Engines for a leg: live, not draining, not failed for this request, and (while others
        exist) not one whose stream broke in the last SUSPECT_S (the registry drops a dead one by then)."""
        now = time.monotonic()
        broken = {i for i, t in self.suspect.items() if now - t < SUSPECT_S}
        impostors = {i for i, t in self.untrusted.items() if now - t < UNTRUSTED_S}
        live = [e for e in self.engines.values()
                if not e.draining and e.engine_id not in failed and e.engine_id not in impostors]
        live = [e for e in live if e.engine_id not in broken] or live
        if phase == "decode":
            pool = [e for e in live if e.role == "decode"] or [e for e in live if e.decodes()]
        elif phase == "prefill":
            pool = [e for e in live if e.role == "prefill"] or [e for e in live if e.prefills()]
        else:
            pool = [e for e in live if e.role == "both"] or [e for e in live if e.prefills()]
        return pool or live

    async def _pick(self, phase: str, tokens: list[int], decision: HitDecision, req: EngineRequest,
                    failed: set[str]) -> EngineInfo:
        deadline = time.monotonic() + NO_ENGINE_WAIT_S
        while True:
            pool = self._candidates(phase, failed) or self._candidates(phase, set())
            if pool:
                break
            if time.monotonic() > deadline:
                raise EngineFailed("no engine is available to serve the request")
            await asyncio.sleep(self.poll_s)
            with contextlib.suppress(Exception):
                await self.refresh()
        if phase == "decode":
            return self.router.pick_decode(pool, self.loads)
        key = req.keys[0] if req.keys else bytes(16)
        view = PromptView(len(tokens), len(tokens) - decision.hit_tokens, key)
        return self.router.pick_prefill(view, pool, self.loads)

    async def _leg(self, engine: EngineInfo, body: GenerateBody, hit: int, rejectable: bool
                   ) -> AsyncIterator[TokenEvent]:
        """The events of one leg; LegBroken when it ends without a last event. The first leg of a
        request may be refused (EngineRejected: the client's mistake); a later one never is."""
        assert self.client is not None
        load = self.loads.setdefault(engine.engine_id, Load())
        queued = len(body.tokens) - hit
        load.running += 1
        load.queued_prefill_tokens += queued
        try:
            content = body.model_dump_json().encode()
            headers = await self._authenticated(engine, content)
            async with self.client.stream("POST", engine.url + GENERATE_PATH, headers=headers, content=content) as r:
                if r.status_code == 400 and rejectable:
                    raise EngineRejected(_message(await r.aread()))
                if r.status_code == 401:   # it forgot our session (a restart): the next leg opens a new one
                    self.sessions.forget(engine.url)
                if r.status_code != 200:
                    raise LegBroken(f"HTTP {r.status_code}: {_message(await r.aread())}")
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue   # keepalive
                    ev = WireEvent.model_validate_json(line)
                    if queued:
                        load.queued_prefill_tokens -= queued
                        queued = 0
                    if ev.error is not None:
                        if ev.error.startswith("rejected") and rejectable:
                            raise EngineRejected(ev.error.removeprefix("rejected: "))
                        raise LegBroken(ev.error)
                    yield ev.token_event(body.request_id, engine.vocab_size)
                    if ev.finished:
                        return
            raise LegBroken("the stream ended without its last event")
        except (httpx.HTTPError, ValueError) as e:
            if isinstance(e, EngineRejected):
                raise
            raise LegBroken(f"{type(e).__name__}: {e}") from None
        finally:
            load.running -= 1
            load.queued_prefill_tokens -= queued


    async def _authenticated(self, engine: EngineInfo, content: bytes) -> dict[str, str]:
        """The headers of one generate call; LegBroken (the engine set aside) when it cannot prove the token."""
        assert self.client is not None
        try:
            auth = await self.sessions.headers(self.client, engine.url, "POST", GENERATE_PATH, content)
        except ProofFailed as e:
            self.untrusted[engine.engine_id] = time.monotonic()
            log.warning("engine %r at %s is not one of this cluster's (%s): no request goes to it",
                        engine.engine_id[:64], engine.url[:200], e)
            raise LegBroken(f"not a cluster engine: {e}") from None
        return {**auth, "Content-Type": "application/json"}


def _limits(e: EngineInfo) -> tuple:
    return e.model, e.max_model_len, e.vocab_size, e.eos_token_ids


def _message(raw: bytes) -> str:
    try:
        import json

        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")
