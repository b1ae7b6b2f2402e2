"""Slow and idle clients cannot hold a kvledger HTTP server's connections, and one client's connections never
deny another's: real sockets against `util.http_server` on a thread (the header deadline, keep-alive, the
connection limits per client and in all, the fd limit). Clients apart are loopback addresses apart (127.0.0.x)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvledger.util.http_server import ConnectionLimits, client_of
from tests.util.servers import closed_within, connect_from, held_open, running, trickling

DEADLINE_S = 0.5
SLACK_S = 3.0   # a loaded 2-core machine
GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


def _app() -> Starlette:
    async def ok(request):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/ok", ok)])


def _get(conn: socket.socket) -> bytes:
    """The status line of GET /ok on `conn`."""
    conn.sendall(GET)
    return conn.recv(65536).split(b"\r\n", 1)[0]


def _close(conns: list[socket.socket]) -> None:
    for conn in conns:
        conn.close()


def test_silent_connections_are_closed_at_the_header_deadline():
    with running(_app(), header_timeout_s=DEADLINE_S) as port:
        conns = [connect_from(port) for _ in range(20)]
        started = time.monotonic()
        results = [closed_within(c, DEADLINE_S + SLACK_S) for c in conns]
        assert all(closed for closed, _ in results) and all(got == b"" for _, got in results)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        for c in conns:
            c.close()


def test_headers_sent_byte_by_byte_get_408_and_are_closed():
    with running(_app(), header_timeout_s=DEADLINE_S) as port, connect_from(port) as conn:
        with trickling(conn, GET[:20], 0.05):   # never the whole head within the deadline
            closed, got = closed_within(conn, DEADLINE_S + SLACK_S)
        assert closed and got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_prompt_requests_are_served_and_a_kept_alive_connection_is_closed_when_idle():
    with running(_app(), header_timeout_s=DEADLINE_S) as port, connect_from(port) as conn:
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


def test_one_clients_connections_beyond_the_caps_never_deny_another_client():
    """The review's attack, scaled down: one client holds more idle connections than --max-connections (16: its
    default share is 16 / 8 = 2); another client's requests are served. Before the fix every one got 503."""
    with running(_app(), max_connections=16) as port:
        flood = [connect_from(port, "127.0.0.2") for _ in range(40)]
        try:
            time.sleep(0.3)
            for _ in range(5):
                with connect_from(port) as conn:
                    assert _get(conn) == b"HTTP/1.1 200 OK"
            assert held_open(flood) == 2
        finally:
            _close(flood)


def test_a_clients_connections_beyond_its_cap_are_closed_at_accept_and_its_closed_ones_count_no_more():
    with running(_app(), header_timeout_s=30, max_connections_per_client=3) as port:
        mine = [connect_from(port, "127.0.0.2") for _ in range(10)]
        try:
            assert held_open(mine) == 3          # closed at once, long before the header deadline
            _close(mine)
            time.sleep(0.3)
            mine = [connect_from(port, "127.0.0.2") for _ in range(3)]
            assert held_open(mine) == 3          # room again
            with connect_from(port) as conn:     # another client meanwhile
                assert _get(conn) == b"HTTP/1.1 200 OK"
        finally:
            _close(mine)


def test_a_full_server_closes_an_idle_connection_of_the_client_holding_most_for_a_newcomer():
    with running(_app(), header_timeout_s=30, max_connections=8, max_connections_per_client=6) as port:
        heavy = [connect_from(port, "127.0.0.2") for _ in range(6)]
        light = [connect_from(port, "127.0.0.3") for _ in range(2)]
        try:
            assert held_open(heavy + light) == 8   # full
            with connect_from(port) as conn:       # a third client: one of the heavy one's goes for it
                assert _get(conn) == b"HTTP/1.1 200 OK"
                assert held_open(heavy) == 5 and held_open(light) == 2
        finally:
            _close(heavy + light)


def test_connections_beyond_max_connections_are_closed_at_accept_when_no_client_holds_more():
    with running(_app(), header_timeout_s=30, max_connections=4) as port:
        each = [connect_from(port, f"127.0.0.{i}") for i in range(2, 6)]   # 4 clients, one connection each: full
        try:
            assert held_open(each) == 4
            with connect_from(port, "127.0.0.6") as late:
                closed, got = closed_within(late, 2.0)
                assert closed and got == b""
            assert held_open(each) == 4
        finally:
            _close(each)


def test_a_client_is_an_ipv4_address_or_an_ipv6_64():
    assert client_of(("192.0.2.7", 5000)) == "192.0.2.7"
    assert client_of(("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == client_of(("2001:db8:1:2:bbbb::9", 6000, 0, 0))
    assert client_of(("2001:db8:1:2::1", 5000, 0, 0)) != client_of(("2001:db8:1:3::1", 5000, 0, 0))
    assert client_of(("::ffff:192.0.2.7", 5000, 0, 0)) == "192.0.2.7"
    assert client_of("/run/kvledger.sock") == ""


def test_max_connections_is_fitted_to_the_fd_limit():
    assert ConnectionLimits.fitted(2048, None, 1024, 80) == ConnectionLimits(472, 59, 118)   # half the spare kept
    assert ConnectionLimits.fitted(2048, None, 20000, 80) == ConnectionLimits(2048, 64, 128)  # room for all
    assert ConnectionLimits.fitted(2048, 500, 100, 99) == ConnectionLimits(1, 1, 1)
    code = ("import resource; from kvledger.util.http_server import Config; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300)); "
            "c = Config(lambda: None, max_connections=2048).connections.limits; print(c.total, c.per_client)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    total, per_client = (int(x) for x in out.stdout.split())
    assert 0 < total < 150 and per_client == max(1, total // 8), out.stdout   # under half of the 300 fds
    assert f"--max-connections 2048 lowered to {total}: the fd limit is 300" in out.stderr, out.stderr


def test_the_soft_fd_limit_is_raised_to_the_hard_one():
    code = ("import resource; from kvledger.util.http_server import raise_fd_limit; "
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    returned, soft, hard = (int(x) for x in out.stdout.split())
    assert returned == soft == min(hard, 1 << 20) > 256, out.stdout
