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

Slow and idle clients (`Config`) cannot hold connections, and so file descriptors, for long:

    what the client does                                   what the server does
    connects and sends nothing, or headers byte by byte    408 (nothing sent: closes) after header_timeout_s
    idles on a kept-alive connection                       closes after KEEP_ALIVE_S
    trickles the body                                      408 (entrypoint/body_limit.py, --body-timeout-s)
    opens more than max_connections                        503 for each request beyond (uvicorn)

and `Server` raises the soft RLIMIT_NOFILE to the hard limit, so a crowd of connections meets the
deadlines above, not EMFILE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvledger.util.output import EXIT_INTERRUPTED, CliError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HEADER_TIMEOUT_S = 10.0   # a request's line and headers must all be in within this long (default --header-timeout-s)
KEEP_ALIVE_S = 5          # an idle kept-alive connection is closed after this long (uvicorn's default, made explicit)
MAX_CONNECTIONS = 2048    # open connections (or requests in flight) before requests get 503 (--max-connections)
FD_LIMIT_CAP = 1 << 20    # the soft RLIMIT_NOFILE when the hard one is unlimited


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
    sock.listen(128)
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


class Config(uvicorn.Config):
    """uvicorn's Config with the limits of the module docstring: `header_timeout_s` (seconds from a
    connection's start, or from its previous response's end, to the end of a request's headers),
    `max_connections` (uvicorn's limit_concurrency) and KEEP_ALIVE_S. The HTTP protocol is always h11
    (`DeadlineH11Protocol`), whichever uvicorn extras are installed."""

    def __init__(self, app: Any, *, header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 **options: Any) -> None:
        assert header_timeout_s > 0 and max_connections > 0
        options.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
        super().__init__(app, http=DeadlineH11Protocol, limit_concurrency=max_connections, **options)
        self.header_timeout_s = header_timeout_s


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline. While a connection waits for a request's headers
    (h11's `their_state` is IDLE: from its start, and again once a response has ended), one timer runs;
    the headers all in (IDLE left) stop it. When it fires, the connection is closed, after a 408 in
    OpenAI's error object if part of a request came (a client that sent nothing gets nothing)."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kw: Any) -> None:
        super().__init__(config, *args, **kw)
        self.header_timeout_s: float = getattr(config, "header_timeout_s", HEADER_TIMEOUT_S)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

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
    stderr once the server accepts connections. Building one raises the soft fd limit (`raise_fd_limit`)."""

    def __init__(self, config: uvicorn.Config, *, on_interrupt: Callable[[], None],
                 on_terminate: Callable[[], None], ready: str | None = None) -> None:
        super().__init__(config)
        raise_fd_limit()
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
        if self.started and self.ready and not self.should_exit:
            print(self.ready, file=sys.stderr, flush=True)
