"""Slow and idle clients cannot hold a kvledger HTTP server's connections: real sockets against
`util.http_server` on a thread (the header deadline, keep-alive, the connection limit, the fd limit)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests.util.servers import closed_within, running, trickling

DEADLINE_S = 0.5
SLACK_S = 3.0   # a loaded 2-core machine
GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


def _app() -> Starlette:
    async def ok(request):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/ok", ok)])


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_silent_connections_are_closed_at_the_header_deadline():
    with running(_app(), header_timeout_s=DEADLINE_S) as port:
        conns = [_connect(port) for _ in range(20)]
        started = time.monotonic()
        results = [closed_within(c, DEADLINE_S + SLACK_S) for c in conns]
        assert all(closed for closed, _ in results) and all(got == b"" for _, got in results)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        for c in conns:
            c.close()


def test_headers_sent_byte_by_byte_get_408_and_are_closed():
    with running(_app(), header_timeout_s=DEADLINE_S) as port, _connect(port) as conn:
        with trickling(conn, GET[:20], 0.05):   # never the whole head within the deadline
            closed, got = closed_within(conn, DEADLINE_S + SLACK_S)
        assert closed and got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_prompt_requests_are_served_and_a_kept_alive_connection_is_closed_when_idle():
    with running(_app(), header_timeout_s=DEADLINE_S) as port, _connect(port) as conn:
        for _ in range(2):
            conn.sendall(GET)
            reply = b""
            while not reply.endswith(b"\r\n\r\nok"):
                reply += conn.recv(65536) or b"!closed"
                assert not reply.endswith(b"!closed"), reply
            assert reply.startswith(b"HTTP/1.1 200 "), reply
            time.sleep(DEADLINE_S / 2)   # each request's head comes within the deadline
        closed, _ = closed_within(conn, DEADLINE_S + SLACK_S)
        assert closed


def test_connections_beyond_max_connections_get_503():
    with running(_app(), max_connections=4) as port:
        idle = [_connect(port) for _ in range(4)]
        time.sleep(0.2)
        with _connect(port) as conn:
            conn.sendall(GET)
            assert conn.recv(65536).startswith(b"HTTP/1.1 503 ")
        for c in idle:
            c.close()


def test_the_soft_fd_limit_is_raised_to_the_hard_one():
    code = ("import resource; from kvledger.util.http_server import raise_fd_limit; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    returned, soft, hard = (int(x) for x in out.stdout.split())
    assert returned == soft == min(hard, 1 << 20) > 256, out.stdout
