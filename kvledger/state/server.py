"""The state server: serves the slot pool's snapshots to other hosts over TCP.

asyncio streams on a background thread of the holder process. Chosen by measurement
(`kvledger bench state` reports it; a prototype on this machine pulled 1.35 MiB at ~0.9× a
plain blocking socket with asyncio streams and ~0.5× with a ZeroMQ ROUTER/DEALER pair) and
because a dead TCP peer shows up as EOF at once, where ZeroMQ reconnects silently and the
caller waits out its timeout.

One pull is one round trip on a kept-alive connection: a 64-byte request, a 40-byte
response header, the snapshot bytes sent straight out of the pinned slot (no copy into a
Python object). The slot stays pinned until the kernel has taken every byte (the write
buffer's high-water mark is 0, so `drain` returns only when it is empty).

Refusals: a wrong token → DENIED, then close; a malformed header or an absurd length
→ BAD, then close (the body is never read). Timeouts: `idle_timeout_s` between requests,
`io_timeout_s` for the rest of a header once its first byte came and for sending a response.
A misbehaving connection is closed; the others are not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import threading
from dataclasses import dataclass

from kvledger.state.pool import SlotPool
from kvledger.state.protocol import (
    REQUEST_BYTES,
    Op,
    ProtocolError,
    Status,
    pack_response,
    token_digest,
    unpack_request,
)

_OK_EMPTY = pack_response(Status.OK)
_MISS = pack_response(Status.MISS)
_DENIED = pack_response(Status.DENIED)
_BAD = pack_response(Status.BAD)


@dataclass(slots=True)
class ServerStats:
    """Counts since start (read them from any thread; each is a plain int)."""

    connections: int = 0
    served: int = 0          # GETs answered with a snapshot
    served_bytes: int = 0
    misses: int = 0          # GETs for a key the pool does not hold
    denied: int = 0          # requests with a wrong token
    bad: int = 0             # malformed frames or absurd lengths
    timeouts: int = 0        # connections closed for a stalled read or write
    refused: int = 0         # connections over `max_connections`


class StateServer:
    """`StateServer(pool, token).start()`; `address` is "host:port"; `stop()` ends it."""

    def __init__(self, pool: SlotPool, token: str | bytes, host: str = "127.0.0.1", port: int = 0, *,
                 io_timeout_s: float = 5.0, idle_timeout_s: float = 60.0, max_connections: int = 256) -> None:
        assert io_timeout_s > 0 and idle_timeout_s > 0 and max_connections > 0
        self.pool = pool
        self.host = host
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.stats = ServerStats()
        self._digest = token_digest(token)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._open = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # --- lifetime ----------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> StateServer:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name=f"kvledger-state-server-{self.host}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("state server did not start in time")
        if self._error is not None:
            raise RuntimeError(f"state server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(self._shutdown)
        thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> StateServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, self.port, reuse_address=True, backlog=512))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _shutdown(self) -> None:
        assert self._loop is not None
        if self._server is not None:
            self._server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.call_soon(self._loop.stop)

    # --- one connection ----------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self._open >= self.max_connections:
            self.stats.refused += 1
            writer.transport.abort()
            return
        self._open += 1
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.transport.set_write_buffer_limits(high=0)  # drain() == every byte handed to the kernel
        try:
            while await self._one_request(reader, writer):
                pass
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            if isinstance(e, TimeoutError):
                self.stats.timeouts += 1
        except asyncio.CancelledError:
            pass
        finally:
            self._open -= 1
            writer.transport.abort()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection should close."""
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                first = await reader.read(REQUEST_BYTES)
            if not first:
                return False
            if len(first) < REQUEST_BYTES:
                async with asyncio.timeout(self.io_timeout_s):
                    first += await reader.readexactly(REQUEST_BYTES - len(first))
        except TimeoutError:
            return False  # idle keep-alive connection or a stalled header: just close
        try:
            req = unpack_request(first)
        except ProtocolError:
            self.stats.bad += 1
            await self._send(writer, _BAD)
            return False
        if not hmac.compare_digest(req.token_digest, self._digest):
            self.stats.denied += 1
            await self._send(writer, _DENIED)
            return False
        if req.op is Op.PING:
            await self._send(writer, _OK_EMPTY)
            return True
        assert req.op is Op.GET
        pinned = self.pool.pin(req.key)
        if pinned is None:
            self.stats.misses += 1
            await self._send(writer, _MISS)
            return True
        try:
            writer.write(pack_response(Status.OK, pinned.size, pinned.position, pinned.checksum))
            writer.write(pinned.view)
            async with asyncio.timeout(self.io_timeout_s):
                await writer.drain()
        finally:
            with contextlib.suppress(BufferError):  # a transport that kept a slice of it on a failed send
                pinned.view.release()
            self.pool.unpin(req.key)
        self.stats.served += 1
        self.stats.served_bytes += pinned.size
        return True

    async def _send(self, writer: asyncio.StreamWriter, frame: bytes) -> None:
        writer.write(frame)
        async with asyncio.timeout(self.io_timeout_s):
            await writer.drain()
