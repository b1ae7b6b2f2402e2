"""The state server: serves the slot pool's snapshots to other hosts over TCP.

Blocking sockets, one thread per connection (at most `max_connections`), in the holder
process. Chosen by measurement against the two the issue named: `kvledger bench state`
runs an asyncio-streams server and a ZeroMQ ROUTER/DEALER pair next to it on the same
bytes (`candidates` in its JSON, throughput and server CPU per pull). A pull spends its
time in the kernel copy; what the server adds on top is what the ratio to a plain socket
loses on a busy 2-core machine, and an event loop runs more Python per request than a
blocked thread, which holds no GIL while it waits or sends (the bench's server CPU per
pull shows it). A dead TCP peer shows up as EOF at once, where ZeroMQ reconnects silently and the
caller waits out its timeout.

One pull is one round trip on a kept-alive connection: a 64-byte request, then one
`sendmsg` of the 40-byte response header and the snapshot straight out of its pinned slot
(no copy into a Python object). The slot stays pinned until the kernel has taken every byte.

Refusals: a wrong token → DENIED, then close; a malformed header or an absurd length
→ BAD, then close (no body is ever read). Timeouts: `idle_timeout_s` between requests,
`io_timeout_s` for the rest of a header once its first bytes came (one deadline for the
whole header) and for sending a response. A misbehaving connection is closed; the others
are not affected.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time
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
ACCEPT_POLL_S = 0.1
LINGER_S = 0.2          # how long a refused connection is drained before it is closed
LINGER_BYTES = 1 << 20  # and how much of it at most


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
                 io_timeout_s: float = 5.0, idle_timeout_s: float = 60.0, max_connections: int = 64) -> None:
        assert io_timeout_s > 0 and idle_timeout_s > 0 and max_connections > 0
        self.pool = pool
        self.host = host
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.stats = ServerStats()
        self._digest = token_digest(token)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # --- lifetime ----------------------------------------------------------------

    def start(self) -> StateServer:
        assert self._acceptor is None, "already started"
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        lsock = socket.create_server((self.host, self.port), family=family, backlog=512)
        lsock.settimeout(ACCEPT_POLL_S)  # the acceptor notices stop() within this
        self.port = lsock.getsockname()[1]
        self._listener = lsock
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvledger-state-accept-{self.port}",
                                          daemon=True)
        self._acceptor.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, cut every connection (a pull in flight becomes the puller's miss), join."""
        if self._acceptor is None:
            return
        self._stop.set()
        self._acceptor.join(timeout_s)
        with self._lock:
            conns = dict(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
        for thread in conns.values():
            thread.join(timeout_s)
        assert self._listener is not None
        self._listener.close()
        self._acceptor = None

    def __enter__(self) -> StateServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # e.g. EMFILE: back off instead of spinning
                self._stop.wait(ACCEPT_POLL_S)
                continue
            with self._lock:
                self.stats.connections += 1
                if len(self._conns) >= self.max_connections:
                    self.stats.refused += 1
                    sock.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                          name=f"kvledger-state-conn-{self.port}")
                self._conns[sock] = thread
            thread.start()

    # --- one connection ----------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        head = bytearray(REQUEST_BYTES)
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set() and self._one_request(sock, head):
                pass
        except TimeoutError:
            self._count("timeouts")
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _refuse(self, sock: socket.socket, frame: bytes) -> None:
        """Answer, then close so the answer arrives: half-close and discard what the peer already
        sent (at most LINGER_BYTES, for at most LINGER_S), else a close with unread input sends
        a reset that can overtake the answer. Nothing discarded is ever parsed."""
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_S
        drained = 0
        with contextlib.suppress(OSError):
            while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                n = len(sock.recv(65536))
                if n == 0:
                    break
                drained += n

    def _one_request(self, sock: socket.socket, head: bytearray) -> bool:
        """Answer one request; False when the connection should close. Socket errors propagate."""
        view = memoryview(head)
        sock.settimeout(self.idle_timeout_s)
        try:
            got = sock.recv_into(view)
        except TimeoutError:
            return False  # an idle kept-alive connection: close it quietly
        if got == 0:
            return False
        deadline = time.monotonic() + self.io_timeout_s  # a stalled header counts as a timeout
        while got < REQUEST_BYTES:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            n = sock.recv_into(view[got:])
            if n == 0:
                return False
            got += n
        sock.settimeout(self.io_timeout_s)  # sendall: the total time to send one response
        try:
            req = unpack_request(head)
        except ProtocolError:
            self._count("bad")
            self._refuse(sock, _BAD)
            return False
        if not hmac.compare_digest(req.token_digest, self._digest):
            self._count("denied")
            self._refuse(sock, _DENIED)
            return False
        if req.op is Op.PING:
            sock.sendall(_OK_EMPTY)
            return True
        assert req.op is Op.GET
        pinned = self.pool.pin(req.key)
        if pinned is None:
            self._count("misses")
            sock.sendall(_MISS)
            return True
        try:
            frame = pack_response(Status.OK, pinned.size, pinned.position, pinned.checksum)
            # one syscall for header + snapshot in the common case; the rest from where it stopped
            sent = sock.sendmsg([frame, pinned.view])
            if sent < len(frame):
                sock.sendall(frame[sent:])
                sent = len(frame)
            if sent < len(frame) + pinned.size:
                sock.sendall(pinned.view[sent - len(frame):])
        finally:
            with contextlib.suppress(BufferError):  # a slice of it still referenced after a failed send
                pinned.view.release()
            self.pool.unpin(req.key)
        with self._lock:
            self.stats.served += 1
            self.stats.served_bytes += pinned.size
        return True
