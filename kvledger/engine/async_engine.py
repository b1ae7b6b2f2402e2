"""The engine's step loop in its own thread, its events delivered to the asyncio loop.

The engine is single-threaded: only the loop thread below calls `add_request`, `step` and
`abort`. The server talks to it through a thread-safe inbox that the thread drains before
each step; each step's events go back to the event loop in one `call_soon_threadsafe`. So a
long prefill blocks only this thread, never `/health` or the other routes.

    engine = AsyncEngine(Engine(...)); engine.start(asyncio.get_running_loop())   # an EngineClient (client.py)
    async for event in engine.generate(request): ...     # TokenEvents; the last has finished=True

Faults: a request the engine refuses (`ValueError`) ends with `EngineRejected`; one that failed alone
inside a step (its event's finish_reason "error": sampling, its write-back) ends with `EngineFailed`,
and the others go on; an exception out of `step` itself (the batch's forward) ends every running
request with `EngineFailed`. Either way the thread keeps serving (never a dead worker). A consumer
that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from kvledger.engine.api import EngineRequest, TokenEvent
from kvledger.engine.client import EngineFailed, EngineRejected
from kvledger.engine.threads import release_team

log = logging.getLogger("kvledger.serve")
IDLE_WAIT_S = 0.05
FAILURE_BACKOFF_S = 0.1   # after a failed step, so a broken engine cannot spin the thread


class StepEngine(Protocol):
    def add_request(self, req: EngineRequest) -> None: ...
    def step(self, *, defer_stores: bool = False) -> list[TokenEvent]: ...
    def flush_stores(self) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def hand_off(self, request_id: str) -> None: ...
    def request_ids(self) -> list[str]: ...
    def has_unfinished(self) -> bool: ...
    def forget(self, tenant: str) -> dict[str, int]: ...
    def close(self) -> None: ...


class AsyncEngine:
    """The in-process `EngineClient`. Invariant: every request added gets exactly one terminal item (a
    finished event or an error)."""

    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0
        self.failures = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop thread. Call it from the thread that loaded the engine, which computes nothing from
        now on: its OpenMP team is released, or every op of every step would pay a futex sleep and wake-up
        (threads.py, `release_team`)."""
        assert self._thread is None, "started twice"
        release_team()
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kvledger-engine", daemon=True)
        self._thread.start()

    def close(self, grace_s: float | None = None) -> bool:
        """Stop the loop thread after its current step, then close the engine. With `grace_s`, a thread
        still inside a step after that many seconds is left to die with the process, and the engine is
        not closed under it: returns False then, True when everything closed."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30 if grace_s is None else grace_s)
            if self._thread.is_alive():   # nothing of it outlives the process (its shared memory is a memfd)
                return False
        self.engine.close()
        return True

    def hand_off_all(self) -> None:
        """Every running request ends with finish_reason "handoff", its KV stored (cluster scale-down)."""
        self._inbox.put(("handoff", None))

    async def forget(self, tenant: str) -> dict[str, dict[str, int] | None]:
        """`Engine.forget` on the loop thread, between two steps; {"embedded": its counts} (`EngineClient.forget`)."""
        assert self._loop is not None
        done: asyncio.Future = self._loop.create_future()
        self._inbox.put(("forget", (tenant, done)))
        return {"embedded": await done}

    @property
    def running(self) -> int:
        """Requests added and not finished (seen from the event loop's side)."""
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def engine_count(self) -> int:
        return int(self.alive)

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenEvent]:
        """The request's events until it finishes; aborts it if the consumer stops early."""
        assert req.request_id not in self._streams, "request ids are unique"
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = stream
        self._inbox.put(("add", req))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self._inbox.put(("abort", req.request_id))

    # --- the loop thread --------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                events = self.engine.step(defer_stores=True)
            except Exception as e:  # an engine bug: fail what runs, keep serving
                log.exception("engine step failed")
                self.failures += 1
                self._fail_all(e)
                self.engine.flush_stores()   # what the failed step noted, while its blocks are as they were
                time.sleep(FAILURE_BACKOFF_S)
                continue
            self.steps += 1
            if events:
                self._deliver(events)
            self.engine.flush_stores()   # the step's block copies, once its events are on their way

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, op: str, arg: Any) -> None:
        if op == "add":
            try:
                self.engine.add_request(arg)
            except ValueError as e:
                self._post(arg.request_id, EngineRejected(str(e)))
            except Exception as e:
                log.exception("engine add_request failed")
                self._post(arg.request_id, EngineFailed(f"the engine failed to admit the request: {e}"))
        elif op == "handoff":
            for rid in self.engine.request_ids():
                try:
                    self.engine.hand_off(rid)
                except Exception:
                    log.exception("engine hand-off failed")
        elif op == "abort":
            try:
                self.engine.abort(arg)
            except Exception:
                log.exception("engine abort failed")
        elif op == "forget":
            tenant, done = arg
            try:
                counts = self.engine.forget(tenant)
            except Exception as e:
                log.exception("engine forget failed")
                self._call_soon(_settle, done, None, e)
            else:
                self._call_soon(_settle, done, counts, None)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("engine abort after a failed step failed")
            self._post(rid, EngineFailed(f"the engine failed: {type(error).__name__}: {error}"))

    def _post(self, request_id: str, item: Any) -> None:
        self._call_soon(self._put, request_id, item)

    def _deliver(self, events: list[TokenEvent]) -> None:
        self._call_soon(self._put_many, events)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        """On the event loop; nothing once the loop is closed (a step that outlived a Ctrl-C exit)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            if not self._loop.is_closed():
                raise

    def _put(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _put_many(self, events: list[TokenEvent]) -> None:
        for ev in events:
            failed = ev.finish_reason == "error"
            self._put(ev.request_id, EngineFailed("the engine failed on this request alone") if failed else ev)


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Complete `done` on the event loop (unless its waiter went away)."""
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
