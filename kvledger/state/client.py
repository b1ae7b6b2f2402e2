"""Pulling snapshots from other hosts' state servers.

A pull never raises on a network fault: an unreachable, dead, hung, refusing, busy or lying
holder is a miss (None), and `stats` counts it by cause (rule 8: a miss means recompute).
Every pull finishes within its `timeout_s` (connect, handshake, send, every receive and any
back-off share one deadline). A new connection first runs the mutual challenge–response of
`wire.py`: the client checks the server's proof before it reveals anything that depends
on the token, so a server that does not know the token learns only a random nonce. Connections
are kept alive per address, so a pull is one round trip; a kept connection that turns out dead
before any byte of the answer is replaced once, within the same deadline. A BUSY holder (every
connection slot in use) is retried on a new connection after a jittered, doubling back-off.
The answer header is checked against its session MAC and the payload against the checksum it
carries, so a corrupt or forged transfer is a miss, never a wrong answer.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from kvledger.core import KEY_BYTES
from kvledger.state import auth
from kvledger.state.pool import running_checksum
from kvledger.state.handshake import Refused, after_handshake, open_session, recv_exact
from kvledger.state.handshake import settimeout as _settimeout
from kvledger.state.sockio import recv_fill, recvmsg_some, send_all
from kvledger.state.wire import RESPONSE_BYTES, Op, ProtocolError, PullResponse, PullStatus, Session

DEFAULT_TIMEOUT_S = 2.0
MISS_CAUSES = ("miss", "denied", "auth", "busy", "bad", "unreachable", "timeout", "eof", "reset", "protocol",
               "corrupt", "too_big")
BACKOFF_S = (0.005, 0.2)  # first and longest wait after a BUSY answer (doubling, jittered)


class Pulled(NamedTuple):
    size: int      # bytes written at the start of the buffer
    position: int  # token position of the snapshot


@dataclass(slots=True)
class _Conn:
    """An authenticated connection: requests carry `seq` and a MAC under `session`."""

    sock: socket.socket
    session: Session
    seq: int = 0
    pending: bytes = b""  # the handshake's proof, sent together with the first request

    def request(self, op: Op, key: bytes) -> tuple[int, bytes]:
        seq, self.seq = self.seq, self.seq + 1
        frame = self.pending + self.session.request(op, seq, key)
        self.pending = b""
        return seq, frame


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
        self._keys = auth.derive_keys(token)  # ValueError for an empty token
        if not timeout_s > 0:
            raise ValueError(f"pull timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_idle = max_idle_per_address
        self._idle: dict[str, list[_Conn]] = {}
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
        """True when a state server answers at `address` and both sides prove the token."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        conn = None
        try:
            conn = self._connect(address, deadline)
            seq, frame = conn.request(Op.PING, bytes(KEY_BYTES))
            _settimeout(conn.sock, deadline)
            conn.sock.sendall(frame)
            resp = conn.session.read_answer(recv_exact(conn.sock, RESPONSE_BYTES, deadline), bytes(KEY_BYTES))
            return resp.status is PullStatus.OK and resp.seq == seq
        except (OSError, EOFError, _Fault, ProtocolError):
            return False
        finally:
            if conn is not None:
                conn.sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.sock.close()

    def __enter__(self) -> StateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one pull ----------------------------------------------------------------

    def _pull(self, address: str, key: bytes, out: memoryview | None,
              timeout_s: float | None) -> tuple[bytearray | None, Pulled] | None:
        assert len(key) == KEY_BYTES
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        fresh, wait = False, BACKOFF_S[0]
        while True:
            conn = None
            try:
                conn, reused = self._checkout(address, deadline, fresh)
                result = self._exchange(conn, key, out, deadline, reused)
            except _Fault as f:
                if conn is not None:
                    conn.sock.close()
                if f.cause == "busy" and _backoff(wait, deadline):
                    fresh, wait = True, min(2 * wait, BACKOFF_S[1])
                    continue
                if f.retry and not fresh and time.monotonic() < deadline:
                    fresh = True  # the kept connection had died; try one new one
                    continue
                self.stats[f.cause] += 1
                return None
            except BaseException:
                if conn is not None:
                    conn.sock.close()
                raise
            self._checkin(address, conn)  # a hit or an orderly miss: the connection stays usable
            self.stats["miss" if result is None else "hit"] += 1
            return result

    def _exchange(self, conn: _Conn, key: bytes, out: memoryview | None, deadline: float,
                  reused: bool) -> tuple[bytearray | None, Pulled] | None:
        head = bytearray(RESPONSE_BYTES)
        sock = conn.sock
        seq, frame = conn.request(Op.GET, key)
        try:
            send_all(sock, [frame], deadline)
            # one scatter read takes the header and, usually, the first part of the payload
            got = recvmsg_some(sock, [head, out] if out is not None else [head], deadline)
            if got == 0:
                raise _Fault("eof", retry=reused)
            if got < RESPONSE_BYTES:
                if recv_fill(sock, memoryview(head)[got:], deadline) < RESPONSE_BYTES - got:
                    raise _Fault("eof")
                got = RESPONSE_BYTES
        except TimeoutError:
            raise _Fault("timeout") from None
        except (ConnectionResetError, BrokenPipeError):
            raise _Fault("reset", retry=reused) from None
        except OSError:
            raise _Fault("reset") from None
        resp = _answer(head, conn.session, key, seq, extra=got > RESPONSE_BYTES)
        if resp.status is PullStatus.MISS:
            return None
        early = got - RESPONSE_BYTES  # payload bytes the scatter read already put into `out`
        if out is None:
            buf = bytearray(resp.length)
            dest = memoryview(buf)
        else:
            if resp.length > out.nbytes or early > resp.length:
                raise _Fault("too_big" if resp.length > out.nbytes else "protocol")
            buf, dest = None, out[:resp.length]
        digest = running_checksum()   # fed as the bytes arrive: hashed while the rest is still on its way
        digest.update(dest[:early])
        if early < resp.length:   # the rest, hashed piece by piece as it lands
            try:
                if recv_fill(sock, dest[early:], deadline, digest) < resp.length - early:
                    raise _Fault("eof")
            except TimeoutError:
                raise _Fault("timeout") from None
            except OSError:
                raise _Fault("reset") from None
        if digest.intdigest() != resp.checksum:
            raise _Fault("corrupt")
        return buf, Pulled(resp.length, resp.position)

    # --- connections -------------------------------------------------------------

    def _checkout(self, address: str, deadline: float, fresh: bool) -> tuple[_Conn, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(address)
                if idle:
                    return idle.pop(), True
        return self._connect(address, deadline), False

    def _connect(self, address: str, deadline: float) -> _Conn:
        """A new connection that proved the server knows the token; its own proof goes out
        with the first request (`_Conn.pending`)."""
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
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return self._handshake(sock, deadline)
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket, deadline: float) -> _Conn:
        try:
            session, proof = open_session(sock, self._keys.handshake, deadline)
        except TimeoutError:
            raise _Fault("timeout") from None
        except EOFError:
            raise _Fault("eof") from None
        except Refused as r:
            raise _Fault(r.cause) from None  # "auth": it does not know the token, so it is told nothing more
        except OSError:
            raise _Fault("reset") from None
        after_handshake(sock)
        return _Conn(sock, Session(session), pending=proof)

    def _checkin(self, address: str, conn: _Conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.sock.close()


def _answer(head: bytearray, session: Session, key: bytes, seq: int, extra: bool) -> PullResponse:
    """The checked answer header to request `seq` for `key` (OK or MISS); _Fault otherwise.
    `extra`: payload bytes already arrived behind the header."""
    try:
        resp = session.read_answer(head, key)
    except ProtocolError:
        raise _Fault("protocol") from None
    if resp.status is PullStatus.DENIED:
        raise _Fault("denied")
    if resp.seq != seq or (extra and resp.status is not PullStatus.OK):
        raise _Fault("protocol")  # out of step: an old, injected or trailing answer
    if resp.status is PullStatus.BUSY:
        raise _Fault("busy")
    if resp.status is PullStatus.BAD:
        raise _Fault("bad")
    return resp


def _backoff(wait: float, deadline: float) -> bool:
    """Sleep about `wait` (jittered ±50 %) if the deadline leaves room for another try after it."""
    pause = wait * random.uniform(0.5, 1.5)
    if time.monotonic() + pause >= deadline:
        return False
    time.sleep(pause)
    return True


_default: StateClient | None = None
_default_lock = threading.Lock()


def pull(address: str, key: bytes, timeout: float = DEFAULT_TIMEOUT_S, *, token: str | bytes) -> bytearray | None:
    """One pull with a process-wide client for `token` (see `StateClient.pull`)."""
    global _default
    with _default_lock:
        if _default is None or _default._keys != auth.derive_keys(token):
            _default = StateClient(token)
        client = _default
    return client.pull(address, key, timeout)
