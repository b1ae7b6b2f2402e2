"""An ASGI middleware that bounds request bodies in bytes (413) and in time (408), with OpenAI's error object.

A declared Content-Length over the limit is refused before any byte is read; a body sent
without one (chunked) is counted as it arrives and refused once it passes the limit. Bytes
are counted, not characters. The whole body must be in within `timeout_s` seconds of the
request's start (its headers in): a body trickled a byte at a time is cut off then, never
waited on forever. Both refusals close the connection.

Before a 413 the rest of the body is read and dropped, up to DRAIN_BYTES in all and within the same
deadline: a server that answers and closes while the client is still sending resets the connection,
and the client loses the answer it was sent (it sees a broken connection, not the 413). A body
declared larger than DRAIN_BYTES is refused at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_TIMEOUT_S = 30.0   # default --body-timeout-s: 4 MiB (the default --max-body-bytes) at ≥ 140 KB/s
DRAIN_BYTES = 16 << 20  # the most of a refused body read (and dropped) so that its client gets the 413


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[str], None] | None = None,
                 timeout_s: float = BODY_TIMEOUT_S) -> None:
        """`on_reject(code)`: called with the error code of each refusal ("request_too_large", "request_timeout")."""
        assert max_bytes > 0 and timeout_s > 0
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        deadline = time.monotonic() + self.timeout_s
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            if declared.isdigit() and int(declared) <= DRAIN_BYTES:
                await _drain(receive, deadline, DRAIN_BYTES)
            await self._too_large(send)
            return
        body, more = [], True
        size = 0
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                await self._reject(send, 408, f"The request body did not arrive within {self.timeout_s:g} s.",
                                   "request_timeout")
                return
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, deadline, DRAIN_BYTES - size)
                await self._too_large(send)
                return
            body.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _too_large(self, send: Send) -> None:
        await self._reject(send, 413, f"The request body is larger than {self.max_bytes} bytes.", "request_too_large")

    async def _reject(self, send: Send, status: int, message: str, code: str) -> None:
        if self.on_reject is not None:
            self.on_reject(code)
        payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


async def _drain(receive: Receive, deadline: float, budget: int) -> None:
    """Read and drop the request's body until its end, `budget` bytes, the deadline or a disconnect."""
    while budget > 0:
        try:
            message = await asyncio.wait_for(receive(), deadline - time.monotonic())
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the buffered body once, then defers to the real one (disconnects)."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
