"""`EngineClient`: the one interface the HTTP side serves requests through, in one process or across many.

    client: EngineClient = AsyncEngine(Engine(...))          # embedded: the engine's loop in a thread
    client: EngineClient = RemoteEngines(registry, ...)      # cluster: legs on engine processes (entrypoint)
    client.start(asyncio.get_running_loop())
    async for event in client.generate(request): ...        # TokenEvents; the last has finished=True

The request carries its chain keys and the CHECK's decision (`EngineRequest`); a client never makes a
second decision of its own for it (a later leg of a cluster request is CHECKed again on prompt + output).
Invariant: each `generate` ends with exactly one finished event or one of the two errors below.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from kvledger.engine.api import EngineRequest, TokenEvent


class EngineRejected(ValueError):
    """The engine refused the request (its message says why): a client error."""


class EngineFailed(RuntimeError):
    """The engine failed while running the request: a server error, the worker lives on."""


@runtime_checkable
class EngineClient(Protocol):
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin serving on `loop` (called once, from the loop's thread)."""

    def generate(self, req: EngineRequest) -> AsyncIterator[TokenEvent]:
        """The request's events until it finishes; a consumer that stops early aborts it."""

    async def forget(self, tenant: str) -> dict[str, dict[str, int] | None]:
        """Forget `tenant` on every engine this client serves through (DESIGN rule 12: `Engine.forget`): engine id →
        what it dropped, or None for an engine that did not answer."""

    @property
    def alive(self) -> bool:
        """A prompt sent now can be served."""

    @property
    def engine_count(self) -> int:
        """Engines this client serves through (1 in one process; those it routes to in the cluster)."""

    def close(self, grace_s: float | None = None) -> bool:
        """Stop; True when everything closed within `grace_s` (None: wait), False when a step is left to
        die with the process."""
