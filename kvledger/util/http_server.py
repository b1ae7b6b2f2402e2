"""How every kvledger HTTP server (`serve`, `entrypoint`, `engine`) listens and stops.

    sock = listen(host, port)              # before any model load: a busy port is one line, exit 2
    server = Server(Config(app, ...), on_interrupt=..., on_terminate=..., ready="... ready at ...")
    server.run(sockets=[sock])
    raise SystemExit(server.exit_code)

    signal            what the server does                                        exit status
    SIGINT (Ctrl-C)   `on_interrupt()` at once (end what is in flight), then stop  130
    SIGTERM, SIGHUP   `on_terminate()` (drain), stop once the streams end          0
    a second signal   stop now, without waiting for connections                   as the first

uvicorn's own handler re-raises the signal after its shutdown (a traceback for SIGINT, death by
signal for SIGTERM); this one does not: the exit status above is the whole answer.

Slow and idle clients (`Config`) cannot hold connections, and so file descriptors, for long, and no one
client's connections make another client's request fail:

    what the client does                                   what the server does
    connects and sends nothing, or headers byte by byte    408 (nothing sent: closes) after header_timeout_s
    idles on a kept-alive connection                       closes after KEEP_ALIVE_S
    trickles the body                                      408 (entrypoint/body_limit.py, --body-timeout-s)
    opens more than per_client connections                 each one beyond is closed at accept (nothing read or sent)
    connects while max_connections are open                the oldest connection waiting for headers of the client
                                                           holding the most is closed for it, when that client holds
                                                           at least 2 more than this one; else this one is closed
                                                           at accept

A client is an IPv4 address or an IPv6 /64 (`client_of`). The limits are counted at accept and at close only
(`ClientConnections`): a request costs nothing more. Building a `Config` raises the soft RLIMIT_NOFILE to the
hard limit and lowers max_connections to what the file descriptors allow (`ConnectionLimits.fitted`), so a
crowd of connections meets the limits above, never EMFILE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvledger.util.output import EXIT_INTERRUPTED, CliError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HEADER_TIMEOUT_S = 10.0   # a request's line and headers must all be in within this long (default --header-timeout-s)
KEEP_ALIVE_S = 5          # an idle kept-alive connection is closed after this long (uvicorn's default, made explicit)
MAX_CONNECTIONS = 2048    # open connections at most (--max-connections), fewer when the fd limit is lower
MAX_CONNECTIONS_PER_CLIENT = 64   # open connections of one client at most (--max-connections-per-client), or an
                                  # eighth of max_connections when that is less
FD_LIMIT_CAP = 1 << 20    # the soft RLIMIT_NOFILE when the hard one is unlimited
FD_RESERVE = 512          # fds kept free beyond those open at start: the store's files, Redis, an entrypoint's
                          # 256 engine connections (remote.py), an engine's state server (at most half the spare)
ACCEPT_BURST = 128        # connections accepted in one turn of the event loop at most
LISTEN_BACKLOG = 2048     # connections the kernel queues before they are accepted (they hold no fd of ours)
IPV4_MAPPED = bytes(10) + b"\xff\xff"   # the first 12 bytes of ::ffff:a.b.c.d


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one); CliError naming --port when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port, never a listening one
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CliError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    return sock


def adopt(fd: int) -> socket.socket:
    """The listening socket a parent bound and handed down as file descriptor `fd` (`kvledger up` binds the
    entrypoint's port before it starts anything, so no port it picks later can take it)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise CliError(f"--listen-fd {fd}: not a socket this process was given ({e.strerror})") from None
    if sock.type != socket.SOCK_STREAM:
        raise CliError(f"--listen-fd {fd}: not a TCP socket")
    return sock


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (FD_LIMIT_CAP when that is unlimited); the soft limit now.
    A limit that cannot be raised stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int:
    """File descriptors this process holds now (0 where the system does not list them)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder))
    return 0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Open connections at most: `total` over all clients, `per_client` of one (`client_of`); and `accept_burst`,
    the connections accepted in one turn of the event loop (uvicorn's `backlog`). 0 < per_client <= total."""

    total: int
    per_client: int
    accept_burst: int = ACCEPT_BURST

    @classmethod
    def fitted(cls, max_connections: int, per_client: int | None, soft_limit: int, in_use: int) -> ConnectionLimits:
        """The limits that fit in `soft_limit` fds when `in_use` are open already: the spare fds less a reserve
        (FD_RESERVE, at most half the spare) for what the server opens later and for sockets accepted but not
        yet closed (a refused one holds its fd for about 4 turns of the loop, so 4 bursts fit in the reserve).
        `per_client` None: MAX_CONNECTIONS_PER_CLIENT, or an eighth of the total when less.

            soft limit   in use   spare    reserve   total (asked 2048)   accept burst
            400          17       383      191       192                  47
            1,024        80       944      472       472                  118
            20,000       80       19,920   512       2,048                128
        """
        spare = max(soft_limit - in_use, 2)
        reserve = min(FD_RESERVE, spare // 2)
        total = max(1, min(max_connections, spare - reserve))
        if per_client is None:
            per_client = max(1, min(MAX_CONNECTIONS_PER_CLIENT, total // 8))
        return cls(total, min(per_client, total), max(1, min(ACCEPT_BURST, reserve // 4)))


def client_of(peer: Any) -> str:
    """What a connection from `peer` (a socket's peername) counts against: its IPv4 address, or the /64 of an
    IPv6 one (a host commonly holds a whole /64); an IPv4-mapped IPv6 address is its IPv4 address. Anything
    else (a Unix socket) is one client, ''."""
    host = peer[0] if isinstance(peer, tuple) and peer else ""
    if ":" not in host:
        return host
    try:
        packed = socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
    except OSError:
        return host
    if packed[:12] == IPV4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return socket.inet_ntop(socket.AF_INET6, packed[:8] + bytes(8)) + "/64"


class ClientConnections:
    """The open connections of one server by client, on its event loop (no lock): which to take, which to
    close for a newcomer (module docstring). Invariants: `total` = the connections held <= limits.total, and
    each client's <= limits.per_client; a client with none has no entry."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.total = 0
        self._by_client: dict[str, dict[DeadlineH11Protocol, None]] = {}   # each client's, oldest first

    def admit(self, conn: DeadlineH11Protocol, client: str) -> bool:
        """Whether `conn` may stay open (it is counted then); False: close it at once, it was never counted."""
        held = len(self._by_client.get(client, ()))
        if held >= self.limits.per_client:
            return False
        if self.total >= self.limits.total and not self._make_room(held):
            return False
        self._by_client.setdefault(client, {})[conn] = None
        self.total += 1
        return True

    def release(self, conn: DeadlineH11Protocol, client: str) -> None:
        """`conn` is closed or closing: it counts no more (a second call does nothing)."""
        mine = self._by_client.get(client)
        if mine is None or conn not in mine:
            return
        del mine[conn]
        self.total -= 1
        if not mine:
            del self._by_client[client]

    def clients(self) -> dict[str, int]:
        """Open connections by client."""
        return {client: len(conns) for client, conns in self._by_client.items()}

    def _make_room(self, newcomer_holds: int) -> bool:
        """Close the oldest connection waiting for headers of the client holding the most, if it holds at least
        2 more than the newcomer (so shares even out and never swap back and forth); whether one was closed."""
        heaviest = max(self._by_client.values(), key=len)
        if len(heaviest) < newcomer_holds + 2:
            return False
        victim = next((c for c in heaviest if c.waiting_for_headers()), None)
        if victim is None:
            return False
        victim.close_for_another()
        return True


class Config(uvicorn.Config):
    """uvicorn's Config with the limits of the module docstring: `header_timeout_s` (seconds from a
    connection's start, or from its previous response's end, to the end of a request's headers),
    `max_connections` and `max_connections_per_client` (`ConnectionLimits.fitted`: building a Config raises the
    soft fd limit and fits them to it, with a line on stderr when it lowers max_connections) and KEEP_ALIVE_S.
    The HTTP protocol is always h11 (`DeadlineH11Protocol`), whichever uvicorn extras are installed."""

    def __init__(self, app: Any, *, header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_client: int | None = None, **options: Any) -> None:
        assert header_timeout_s > 0 and max_connections > 0 and (max_connections_per_client or 1) > 0
        options.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
        soft, in_use = raise_fd_limit(), open_fds()
        limits = ConnectionLimits.fitted(max_connections, max_connections_per_client, soft, in_use)
        # no limit_concurrency (ClientConnections counts); backlog: what asyncio accepts in one loop turn
        super().__init__(app, http=DeadlineH11Protocol, backlog=limits.accept_burst, **options)
        self.header_timeout_s = header_timeout_s
        self.connections = ClientConnections(limits)
        if self.connections.limits.total < max_connections:
            print(f"kvledger: --max-connections {max_connections} lowered to {self.connections.limits.total}: "
                  f"the fd limit is {soft}, {in_use} open, the rest kept for the store, Redis and engine sockets",
                  file=sys.stderr, flush=True)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and the connection limits (`Config.connections`). While a
    connection waits for a request's headers (h11's `their_state` is IDLE: from its start, and again once a
    response has ended), one timer runs; the headers all in (IDLE left) stop it. When it fires, the connection
    is closed, after a 408 in OpenAI's error object if part of a request came (a client that sent nothing gets
    nothing). A connection the limits refuse is aborted in `connection_made`, before uvicorn knows of it."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kw: Any) -> None:
        super().__init__(config, *args, **kw)
        self.header_timeout_s: float = getattr(config, "header_timeout_s", HEADER_TIMEOUT_S)
        self._header_timer: asyncio.TimerHandle | None = None
        self._limits: ClientConnections | None = getattr(config, "connections", None)
        self._client: str | None = None   # what it counts against, once admitted

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._limits is not None:
            client = client_of(transport.get_extra_info("peername"))
            if not self._limits.admit(self, client):
                transport.abort()   # refused: connection_lost comes and finds nothing to undo
                return
            self._client = client
        super().connection_made(transport)
        self._watch_headers()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:   # refused at accept
            return
        self._release()
        self._stop_header_timer()
        super().connection_lost(exc)

    def waiting_for_headers(self) -> bool:
        """Whether it waits for a request's headers (its header timer runs): nothing of a request is in flight."""
        return self._header_timer is not None

    def close_for_another(self) -> None:
        """Close it now (nothing sent) to make room for another client's connection; it counts no more."""
        self._release()
        self._stop_header_timer()
        self.transport.abort()

    def _release(self) -> None:
        if self._limits is not None and self._client is not None:
            self._limits.release(self, self._client)

    def _watch_headers(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        else:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:   # part of a request line or headers is buffered
            self.transport.write(timeout_response(f"The request's headers did not arrive within "
                                                  f"{self.header_timeout_s:g} s."))
        self.transport.close()


def timeout_response(message: str) -> bytes:
    """A whole HTTP/1.1 408 response with OpenAI's error object, that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class Server(uvicorn.Server):
    """uvicorn on an already bound socket, with the signals of the module docstring. `ready` is printed to
    stderr once the server accepts connections."""

    def __init__(self, config: uvicorn.Config, *, on_interrupt: Callable[[], None],
                 on_terminate: Callable[[], None], ready: str | None = None) -> None:
        super().__init__(config)
        self.on_interrupt, self.on_terminate, self.ready = on_interrupt, on_terminate, ready
        self.stop_signal: int | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT else 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # a signal this process was started ignoring stays ignored (`nohup`'s SIGHUP), as in `kvledger up`
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS
                    if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """In the signal handler, on the main thread. A BaseException of a callback (an engine's
        StartupInterrupted) goes on into the code the signal interrupted, with the server already set to exit."""
        if self.stop_signal is not None:
            self.force_exit = self.should_exit = True
            return
        self.stop_signal, self.should_exit = sig, True
        try:
            (self.on_interrupt if sig == signal.SIGINT else self.on_terminate)()
        except Exception as e:  # noqa: BLE001 - stopping anyway
            print(f"kvledger: while stopping: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or ():   # asyncio listened with its accept burst (`backlog`); the kernel may queue more
            sock.listen(LISTEN_BACKLOG)
        if self.started and self.ready and not self.should_exit:
            print(self.ready, file=sys.stderr, flush=True)
