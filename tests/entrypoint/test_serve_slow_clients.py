"""Slowloris against a real `kvledger serve --model tiny-v4` with its default limits but a body deadline of
3 s instead of 30 (the same code, a tenth of the wait): idle and half-open connections are closed at the
header deadline, a trickled body is cut off at the body deadline, and /health answers while more connections
are open than the soft fd limit it was started with."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import time

import pytest

from kvledger.util.http_server import HEADER_TIMEOUT_S
from kvledger.util.serve_process import ServeProcess, request
from tests.util.servers import closed_within, trickling

STARTED_SOFT_LIMIT = 1024   # the report's RLIMIT_NOFILE
IDLE = 1100                 # more connections than that
SLACK_S = 8.0               # a loaded 2-core machine
BODY_TIMEOUT_S = 3.0        # --body-timeout-s


@contextlib.contextmanager
def soft_fd_limit(n: int):
    """This process's soft RLIMIT_NOFILE is `n` while the block runs (what a child started in it inherits)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * IDLE + 256:
        pytest.skip("the hard fd limit is too low for this many connections")
    with soft_fd_limit(STARTED_SOFT_LIMIT):
        s = ServeProcess(tmp_path_factory.mktemp("slow") / "data", "--body-timeout-s", str(BODY_TIMEOUT_S),
                         model="tiny-v4").start()
    try:
        yield s
    finally:
        s.stop()


def _connect(port: int) -> socket.socket | None:
    with contextlib.suppress(OSError):
        return socket.create_connection(("127.0.0.1", port), timeout=2)
    return None


def test_health_answers_while_more_idle_connections_than_the_fd_limit_are_open(server):
    conns = [c for c in (_connect(server.port) for _ in range(IDLE)) if c is not None]
    try:
        assert len(conns) == IDLE
        started = time.monotonic()
        status, body = request(server.url + "/health", timeout=10)
        assert status == 200 and time.monotonic() - started < 5, body
    finally:
        for c in conns:
            c.close()


def test_half_open_connections_are_closed_at_the_header_deadline(server):
    conns = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(50)]
    conns[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # half a head; the rest say nothing
    started = time.monotonic()
    try:
        results = [closed_within(c, HEADER_TIMEOUT_S + SLACK_S - (time.monotonic() - started)) for c in conns]
        assert all(closed for closed, _ in results), f"{sum(not c for c, _ in results)} of 50 still open"
        assert time.monotonic() - started >= HEADER_TIMEOUT_S - 1.0   # not before the deadline
        assert results[0][1].startswith(b"HTTP/1.1 408 ") and all(got == b"" for _, got in results[1:])
    finally:
        for c in conns:
            c.close()


def test_a_trickled_body_is_cut_off_at_the_body_deadline(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n")
        started = time.monotonic()
        with trickling(conn, b" " * 100000, 0.2):   # 1 byte per 0.2 s
            closed, got = closed_within(conn, BODY_TIMEOUT_S + SLACK_S)
        assert closed and got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert BODY_TIMEOUT_S - 1.0 <= time.monotonic() - started <= BODY_TIMEOUT_S + SLACK_S
