"""A kvledger HTTP server (`util.http_server`) on a thread of the test process, on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvledger.util.http_server import Config, Server, listen


@contextlib.contextmanager
def running(app: Any, **options: Any) -> Iterator[int]:
    """Serve `app` with `Config(app, **options)` until the block ends; yields the port."""
    sock = listen("127.0.0.1", 0)
    server = Server(Config(app, log_config=None, log_level="warning", **options), on_interrupt=lambda: None,
                    on_terminate=lambda: None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the server did not start"
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def connect_from(port: int, source: str = "127.0.0.1", timeout: float = 5) -> socket.socket:
    """A connection to 127.0.0.1:`port` from the loopback address `source` (Linux routes all of 127/8 to lo, so
    each address is a client of its own to the server)."""
    conn = socket.socket()
    conn.settimeout(timeout)
    try:
        conn.bind((source, 0))
        conn.connect(("127.0.0.1", port))
    except OSError:
        conn.close()
        raise
    return conn


def held_open(conns: list[socket.socket], settle_s: float = 0.5) -> int:
    """How many of `conns` the server still holds open after `settle_s`, on which it has sent nothing."""
    time.sleep(settle_s)
    held = 0
    for conn in conns:
        timeout = conn.gettimeout()
        conn.setblocking(False)
        try:
            held += conn.recv(1) != b""   # b"": closed
        except BlockingIOError:
            held += 1
        except OSError:   # reset
            pass
        conn.settimeout(timeout)
    return held


def closed_within(conn: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed `conn` within `seconds`, what it sent before)."""
    conn.settimeout(0.1)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


@contextlib.contextmanager
def trickling(conn: socket.socket, data: bytes, every_s: float) -> Iterator[None]:
    """Send `data` a byte per `every_s` seconds on a thread while the block runs (the test reads meanwhile,
    so a reply is read before the reset that a byte sent after the server's close brings)."""
    stop = threading.Event()

    def send() -> None:
        for byte in data:
            if stop.wait(every_s):
                return
            try:
                conn.send(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
