"""Pulling snapshots from other hosts' state servers.

A pull never raises on a network fault: an unreachable, dead, hung, refusing or lying
holder is a miss (None), and `stats` counts it by cause (rule 8: a miss means recompute).
Every pull finishes within its `timeout_s` (connect, send and every receive share one
deadline). Connections are kept alive per address, so a pull is one round trip; a kept
connection that turns out dead before any byte of the answer is replaced once, within the
same deadline. The payload is checked against the checksum the holder computed when it
stored the snapshot, so a corrupt transfer is a miss, never a wrong answer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from typing import NamedTuple

from kvledger.core import KEY_BYTES
from kvledger.state.pool import checksum
from kvledger.state.protocol import (
    RESPONSE_BYTES,
    Op,
    ProtocolError,
    Status,
    pack_request,
    token_digest,
    unpack_response,
)

DEFAULT_TIMEOUT_S = 2.0
MISS_CAUSES = ("miss", "denied", "bad", "unreachable", "timeout", "eof", "reset", "protocol", "corrupt", "too_big")


class Pulled(NamedTuple):
    size: int      # bytes written at the start of the buffer
    position: int  # token position of the snapshot


class _Fault(Exception):
    """A pull that ends as a miss; `cause` is one of MISS_CAUSES; `retry` when a fresh connection may help."""

    def __init__(self, cause: str, retry: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.retry = retry


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" → (host, port); ValueError for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad state server address {address!r}; expected HOST:PORT")
    return host.strip("[]"), int(port)


class StateClient:
    """Pulls snapshots with the cluster token; thread-safe (each pull uses its own connection)."""

    def __init__(self, token: str | bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S, max_idle_per_address: int = 4):
        assert timeout_s > 0
        self._digest = token_digest(token)
        self.timeout_s = timeout_s
        self.max_idle = max_idle_per_address
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()  # "hit" and the MISS_CAUSES

    # --- public ------------------------------------------------------------------

    def pull(self, address: str, key: bytes, timeout_s: float | None = None) -> bytearray | None:
        """The snapshot's bytes (a fresh buffer the caller owns), or None for any miss or fault."""
        got = self._pull(address, key, None, timeout_s)
        return got[0] if got is not None else None

    def pull_into(self, address: str, key: bytes, out: bytearray | memoryview,
                  timeout_s: float | None = None) -> Pulled | None:
        """Receive the snapshot straight into `out` (no allocation); None for any miss or fault.
        On a miss `out` may hold partial bytes: the caller must not use them."""
        got = self._pull(address, key, memoryview(out).cast("B"), timeout_s)
        return got[1] if got is not None else None

    def ping(self, address: str, timeout_s: float | None = None) -> bool:
        """True when a state server answers at `address` and accepts this client's token."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        try:
            sock, _ = self._checkout(address, deadline, fresh=True)
        except _Fault:
            return False
        try:
            _settimeout(sock, deadline)
            sock.sendall(pack_request(Op.PING, self._digest))
            head = _recv_exact(sock, RESPONSE_BYTES, deadline)
            ok = unpack_response(head).status is Status.OK
        except (OSError, _Fault, ProtocolError):
            ok = False
        sock.close()
        return ok

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for s in socks:
                s.close()

    def __enter__(self) -> StateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one pull ----------------------------------------------------------------

    def _pull(self, address: str, key: bytes, out: memoryview | None,
              timeout_s: float | None) -> tuple[bytearray | None, Pulled] | None:
        assert len(key) == KEY_BYTES
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        fresh = False
        while True:
            try:
                sock, reused = self._checkout(address, deadline, fresh)
            except _Fault as f:
                self.stats[f.cause] += 1
                return None
            try:
                result = self._exchange(sock, key, out, deadline, reused)
            except _Fault as f:
                sock.close()
                if f.retry and not fresh and time.monotonic() < deadline:
                    fresh = True  # the kept connection had died; try one new one
                    continue
                self.stats[f.cause] += 1
                return None
            except BaseException:
                sock.close()
                raise
            if result is None:  # an orderly miss: the connection stays usable
                self._checkin(address, sock)
                self.stats["miss"] += 1
                return None
            self._checkin(address, sock)
            self.stats["hit"] += 1
            return result

    def _exchange(self, sock: socket.socket, key: bytes, out: memoryview | None, deadline: float,
                  reused: bool) -> tuple[bytearray | None, Pulled] | None:
        head = bytearray(RESPONSE_BYTES)
        try:
            _settimeout(sock, deadline)
            sock.sendall(pack_request(Op.GET, self._digest, key))
            # one scatter read takes the header and, usually, the first part of the payload
            got = sock.recvmsg_into([head, out] if out is not None else [head])[0]
            if got == 0:
                raise _Fault("eof", retry=reused)
            if got < RESPONSE_BYTES:
                _recv_into(sock, memoryview(head)[got:], deadline)
                got = RESPONSE_BYTES
        except TimeoutError:
            raise _Fault("timeout") from None
        except (ConnectionResetError, BrokenPipeError):
            raise _Fault("reset", retry=reused) from None
        except OSError:
            raise _Fault("reset") from None
        try:
            resp = unpack_response(head)
        except ProtocolError:
            raise _Fault("protocol") from None
        if resp.status is Status.MISS:
            if got > RESPONSE_BYTES:
                raise _Fault("protocol")  # bytes after a miss: the stream is out of step
            return None
        if resp.status is not Status.OK:
            raise _Fault("denied" if resp.status is Status.DENIED else "bad")
        early = got - RESPONSE_BYTES  # payload bytes the scatter read already put into `out`
        if out is None:
            buf = bytearray(resp.length)
            dest = memoryview(buf)
        else:
            if resp.length > out.nbytes or early > resp.length:
                raise _Fault("too_big" if resp.length > out.nbytes else "protocol")
            buf, dest = None, out[:resp.length]
        try:
            _recv_into(sock, dest[early:], deadline)
        except TimeoutError:
            raise _Fault("timeout") from None
        except OSError:
            raise _Fault("reset") from None
        if checksum(dest) != resp.checksum:
            raise _Fault("corrupt")
        return buf, Pulled(resp.length, resp.position)

    # --- connections -------------------------------------------------------------

    def _checkout(self, address: str, deadline: float, fresh: bool) -> tuple[socket.socket, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(address)
                if idle:
                    return idle.pop(), True
        try:
            host, port = parse_address(address)
        except ValueError:
            raise _Fault("unreachable") from None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Fault("timeout")
        try:
            sock = socket.create_connection((host, port), timeout=remaining)
        except TimeoutError:
            raise _Fault("timeout") from None
        except OSError:
            raise _Fault("unreachable") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _checkin(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.max_idle:
                idle.append(sock)
                return
        sock.close()


def _settimeout(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    sock.settimeout(remaining)


def _recv_exact(sock: socket.socket, n: int, deadline: float, retry_on_eof: bool = False) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline, retry_on_eof)
    return bytes(buf)


def _recv_into(sock: socket.socket, dest: memoryview, deadline: float, retry_on_eof: bool = False) -> None:
    """Fill `dest` from `sock` before `deadline`: TimeoutError, or _Fault("eof") when the peer closes."""
    got, n = 0, dest.nbytes
    while got < n:
        _settimeout(sock, deadline)
        k = sock.recv_into(dest[got:], n - got)
        if k == 0:
            raise _Fault("eof", retry=retry_on_eof and got == 0)
        got += k


_default: StateClient | None = None
_default_lock = threading.Lock()


def pull(address: str, key: bytes, timeout: float = DEFAULT_TIMEOUT_S, *, token: str | bytes) -> bytearray | None:
    """One pull with a process-wide client for `token` (see `StateClient.pull`)."""
    global _default
    with _default_lock:
        if _default is None or _default._digest != token_digest(token):
            _default = StateClient(token)
        client = _default
    return client.pull(address, key, timeout)
