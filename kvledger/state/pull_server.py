"""The state server: serves the slot pool's snapshots to other hosts over TCP.

Blocking sockets, one thread per connection, in the holder process. Chosen by measurement
against the two the issue named: `kvledger bench state` runs an asyncio-streams server and a
ZeroMQ ROUTER/DEALER pair next to it on the same bytes (`candidates` in its JSON). A pull
spends its time in the kernel copy; an event loop runs more Python per request than a
blocked thread, which holds no GIL while it waits or sends.

A connection first proves the cluster token (mutual challenge–response, `wire.py`)
within `handshake_timeout_s`; only then does it count against `max_connections`. When every
slot is taken, the least recently used idle connection is closed to make room (its client
reconnects on its next pull); when none is idle the new one is answered BUSY and closed, and
its client backs off and retries within its deadline. At most `max_handshakes` connections
may be proving themselves at once (a flood of silent ones costs a thread each for at most
`handshake_timeout_s`, and never blocks an authenticated pull).

One pull is one round trip on a kept-alive connection: a 64-byte request, then one
`sendmsg` of the 72-byte answer header and the snapshot straight out of its pinned slot
(no copy into a Python object). The slot stays pinned until the kernel has taken every byte.

Refusals: a wrong proof → DENIED, then close; a malformed frame, a bad MAC or an out-of-order
`seq` → close (no body is ever read). Timeouts: `idle_timeout_s` between requests,
`io_timeout_s` for the rest of a request once its first bytes came and for sending an answer.
A misbehaving connection is closed; the others are not affected.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

from kvledger.core import KEY_BYTES
from kvledger.state import auth
from kvledger.state.pool import SlotPool
from kvledger.state.handshake import Refused, accept_session, after_handshake, recv_exact
from kvledger.state.sockio import recv_fill, recv_some, send_all
from kvledger.state.wire import REQUEST_BYTES, Op, ProtocolError, PullStatus, Session, pack_response

ACCEPT_POLL_S = 0.1
LINGER_S = 0.2          # how long a refused connection is drained before it is closed
LINGER_BYTES = 1 << 20  # and how much of it at most
_NO_KEY = bytes(KEY_BYTES)


@dataclass(slots=True)
class ServerStats:
    """Counts since start (read them from any thread; each is a plain int)."""

    connections: int = 0     # accepted
    authenticated: int = 0   # connections that proved the token
    served: int = 0          # GETs answered with a snapshot
    served_bytes: int = 0
    misses: int = 0          # GETs for a key the pool does not hold
    denied: int = 0          # handshakes with a wrong proof
    bad: int = 0             # malformed frames, bad MACs, out-of-order seq
    timeouts: int = 0        # connections closed for a stalled handshake, read or write
    refused: int = 0         # connections over `max_handshakes`, closed unread
    evicted: int = 0         # idle authenticated connections closed to make room
    busy: int = 0            # authenticated connections answered BUSY (every slot busy)


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    idle_since: float | None = None  # monotonic seconds; None while a request is being answered
    used_at: float = field(default_factory=time.monotonic)   # when its last request arrived: the LRU order


class StateServer:
    """`StateServer(pool, token).start()`; `address` is "host:port"; `stop()` ends it."""

    def __init__(self, pool: SlotPool, token: str | bytes, host: str = "127.0.0.1", port: int = 0, *,
                 io_timeout_s: float = 5.0, idle_timeout_s: float = 30.0, handshake_timeout_s: float = 2.0,
                 max_connections: int = 64, max_handshakes: int | None = None) -> None:
        self._keys = auth.derive_keys(token)  # ValueError for an empty token
        if min(io_timeout_s, idle_timeout_s, handshake_timeout_s) <= 0 or max_connections <= 0:
            raise ValueError("state server timeouts and max_connections must be positive")
        self.pool = pool
        self.host = host
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes or 4 * max_connections
        self.stats = ServerStats()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._threads: dict[socket.socket, threading.Thread] = {}  # every open connection
        self._authed: dict[socket.socket, _Conn] = {}              # the ones that count
        self._handshaking = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def idle_connections(self) -> int:
        """Authenticated connections waiting for their next request: the ones `max_connections` may evict."""
        with self._lock:
            return sum(c.idle_since is not None for c in self._authed.values())

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
            threads = dict(self._threads)
        for sock in threads:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
        for thread in threads.values():
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
                if self._handshaking >= self.max_handshakes:
                    self.stats.refused += 1
                    sock.close()
                    continue
                self._handshaking += 1
                thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                          name=f"kvledger-state-conn-{self.port}")
                self._threads[sock] = thread
            thread.start()

    # --- one connection ----------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                session = self._handshake(sock)
            finally:
                with self._lock:
                    self._handshaking -= 1
            if session is None:
                return
            conn = _Conn(sock)
            if not self._admit(conn):
                self._answer_busy(sock, session)
                return
            after_handshake(sock)
            head, seq = bytearray(REQUEST_BYTES), 0
            while self._one_request(conn, session, seq, head):   # stop() shuts the socket: this loop ends
                seq += 1
        except TimeoutError:
            self._count("timeouts")
        except OSError:
            pass
        finally:
            with self._lock:
                self._threads.pop(sock, None)
                self._authed.pop(sock, None)
            sock.close()

    def _handshake(self, sock: socket.socket) -> Session | None:
        """The session key once the peer proved the token within `handshake_timeout_s`; None
        (after answering DENIED, or closing unanswered a frame that does not parse) otherwise."""
        try:
            session = accept_session(sock, self._keys.handshake, time.monotonic() + self.handshake_timeout_s)
        except EOFError:
            return None
        except Refused as r:
            if r.cause != "denied":
                self._count("bad")
                return None
            self._count("denied")
            self._refuse(sock, pack_response(None, PullStatus.DENIED, 0, _NO_KEY))
            return None
        self._count("authenticated")
        return Session(session)

    def _admit(self, conn: _Conn) -> bool:
        """Count an authenticated connection; at the cap, close the least recently used idle one."""
        with self._lock:
            if len(self._authed) >= self.max_connections:
                idle = [c for c in self._authed.values() if c.idle_since is not None]
                if not idle:
                    self.stats.busy += 1
                    return False
                victim = min(idle, key=lambda c: c.used_at)
                del self._authed[victim.sock]
                self.stats.evicted += 1
                with contextlib.suppress(OSError):
                    victim.sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and ends
            self._authed[conn.sock] = conn
            return True

    def _answer_busy(self, sock: socket.socket, session: Session) -> None:
        """Answer the request that came with the proof BUSY (authenticated), then close."""
        try:
            _, seq, key = session.read_request(recv_exact(sock, REQUEST_BYTES,
                                                          time.monotonic() + self.handshake_timeout_s))
        except (ProtocolError, EOFError):
            return
        sock.settimeout(self.io_timeout_s)
        self._refuse(sock, session.answer(PullStatus.BUSY, seq, key))

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

    def _one_request(self, conn: _Conn, session: Session, seq: int, head: bytearray) -> bool:
        """Answer request `seq`; False when the connection should close. Socket errors propagate."""
        sock, view = conn.sock, memoryview(head)
        conn.idle_since = time.monotonic()
        try:
            got = recv_some(sock, view, conn.idle_since + self.idle_timeout_s, False)   # wait first: idle
        except TimeoutError:
            return False  # an idle kept-alive connection: close it quietly
        conn.idle_since, conn.used_at = None, time.monotonic()
        if got == 0:
            return False
        if got < REQUEST_BYTES:   # the rest within io_timeout_s: a stalled request raises TimeoutError, a timeout
            got += recv_fill(sock, view[got:], time.monotonic() + self.io_timeout_s)
            if got < REQUEST_BYTES:
                return False   # closed halfway
        try:
            op, got_seq, key = session.read_request(head)
        except ProtocolError:
            got_seq = -1
        if got_seq != seq:  # forged, replayed or injected: the stream is not ours
            self._count("bad")
            return False
        if op is Op.PING:
            send_all(sock, [session.answer(PullStatus.OK, seq, key)], time.monotonic() + self.io_timeout_s)
            return True
        assert op is Op.GET
        return self._send_snapshot(sock, session, seq, key)

    def _send_snapshot(self, sock: socket.socket, session: Session, seq: int, key: bytes) -> bool:
        deadline = time.monotonic() + self.io_timeout_s  # the total time to send one answer
        pinned = self.pool.pin(key)
        if pinned is None:
            self._count("misses")
            send_all(sock, [session.answer(PullStatus.MISS, seq, key)], deadline)
            return True
        try:
            frame = session.answer(PullStatus.OK, seq, key, pinned.size, pinned.position, pinned.checksum)
            send_all(sock, [frame, pinned.view], deadline)  # one sendmsg in the common case; the rest as room comes
        finally:
            try:   # noqa: SIM105 (not contextlib.suppress: three interpreter calls a pull)
                pinned.view.release()
            except BufferError:   # a slice of it still referenced after a failed send
                pass
            self.pool.unpin(key)
        with self._lock:
            self.stats.served += 1
            self.stats.served_bytes += pinned.size
        return True

