"""How every kvledger HTTP server (`serve`, `entrypoint`, `engine`) listens and stops.

    sock = listen(host, port)              # before any model load: a busy port is one line, exit 2
    server = Server(uvicorn.Config(app, ...), on_interrupt=..., on_terminate=..., ready="... ready at ...")
    server.run(sockets=[sock])
    raise SystemExit(server.exit_code)

    signal            what the server does                                        exit status
    SIGINT (Ctrl-C)   `on_interrupt()` at once (end what is in flight), then stop  130
    SIGTERM, SIGHUP   `on_terminate()` (drain), stop once the streams end          0
    a second signal   stop now, without waiting for connections                   as the first

uvicorn's own handler re-raises the signal after its shutdown (a traceback for SIGINT, death by
signal for SIGTERM); this one does not: the exit status above is the whole answer.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from kvledger.util.output import EXIT_INTERRUPTED, CliError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
        if self.started and self.ready and not self.should_exit:
            print(self.ready, file=sys.stderr, flush=True)
