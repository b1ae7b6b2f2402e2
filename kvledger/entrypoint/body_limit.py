"""An ASGI middleware that refuses request bodies over a limit with 413 and OpenAI's error object.

A declared Content-Length over the limit is refused before any byte is read; a body sent
without one (chunked) is counted as it arrives and refused once it passes the limit. Bytes
are counted, not characters.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] | None = None) -> None:
        assert max_bytes > 0
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(send)
            return
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send)
                return
            body.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _reject(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        payload = json.dumps({"error": {"message": f"The request body is larger than {self.max_bytes} bytes.",
                                        "type": "invalid_request_error", "param": None,
                                        "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


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
