"""The socket calls of an authenticated state connection: non-blocking, one deadline per exchange.

Both sides of a pull move requests and answers with these, on a socket made non-blocking after the
handshake (`handshake.after_handshake`). Each call is tried at once; only one that would block waits in
poll() for what is left of its `deadline` (time.monotonic() seconds), then TimeoutError. Python's own socket
timeouts would poll before every call and switch the descriptor's mode at every `settimeout`.

    send_all(sock, buffers, deadline)              every byte of `buffers` in order, straight out of them
    recv_some(sock, buffer, deadline, ready=True)  what has arrived (>= 1 byte; 0 when the peer closed)
    recvmsg_some(sock, buffers, deadline)          one scatter read, waiting first; as recv_some
    recv_fill(sock, buffer, deadline, digest=None) fill `buffer`, each piece to `digest.update` as it lands;
                                                   the count, short only when the peer closed

They run in C (`_sockio.c`, the same calls with no interpreter between the system calls: a dozen interpreter
calls fewer per pull, docs/state.md) where that optional extension was built, else in the Python below. The
two behave the same: `tests/state/test_sockio.py` runs its cases on both.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol


class Digest(Protocol):
    def update(self, data: memoryview, /) -> None: ...


def wait_for(sock: socket.socket, events: int, deadline: float) -> None:
    """Return once `sock` is ready for `events` (select.POLLIN / POLLOUT), has an error or was hung up
    (the next call reports which); TimeoutError at `deadline`."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    fd = sock.fileno()
    if fd < 0:   # closed: the error a call on it gives, not poll's ValueError
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    poller = select.poll()
    poller.register(fd, events)
    if not poller.poll(math.ceil(remaining * 1000)):
        raise TimeoutError


def py_send_all(sock: socket.socket, buffers: Sequence[Any], deadline: float, /) -> None:
    """Send every byte of `buffers` in order (sendmsg: straight out of them, no copy) before `deadline`.
    Each buffer is bytes or a one-dimensional byte view (its len is its size in bytes)."""
    try:   # the common case: one call takes everything, with no views made
        n = sock.sendmsg(buffers)
    except BlockingIOError:
        n = 0
    if n == sum(map(len, buffers)):
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        while views and n >= views[0].nbytes:
            n -= views.pop(0).nbytes
        if n:
            views[0] = views[0][n:]
        if not views:
            return
        wait_for(sock, select.POLLOUT, deadline)   # the send buffer is full: wait for room
        try:
            n = sock.sendmsg(views)
        except BlockingIOError:
            n = 0


def py_recv_some(sock: socket.socket, view: Any, deadline: float, ready: bool = True, /) -> int:
    """Receive what has arrived into `view` (at least one byte; 0 when the peer closed) before `deadline`.
    `ready=False`: nothing is expected to have arrived yet, so wait first rather than try first."""
    if not ready:
        wait_for(sock, select.POLLIN, deadline)
    while True:
        try:
            return sock.recv_into(view)
        except BlockingIOError:
            wait_for(sock, select.POLLIN, deadline)


def py_recvmsg_some(sock: socket.socket, buffers: Sequence[Any], deadline: float, /) -> int:
    """One scatter read into `buffers` (what has arrived, at least one byte; 0 when the peer closed), waiting
    first: it is the read of an answer just asked for."""
    while True:
        wait_for(sock, select.POLLIN, deadline)
        try:
            return sock.recvmsg_into(buffers)[0]
        except BlockingIOError:
            continue


def py_recv_fill(sock: socket.socket, buffer: Any, deadline: float, digest: Digest | None = None, /) -> int:
    """Fill `buffer` before `deadline`, feeding each piece to `digest` (when given) as it lands; the bytes
    received, fewer than the buffer holds only when the peer closed."""
    dest = memoryview(buffer).cast("B")
    got, n = 0, dest.nbytes
    while got < n:
        k = py_recv_some(sock, dest[got:], deadline)
        if k == 0:
            break
        if digest is not None:
            digest.update(dest[got:got + k])
        got += k
    return got


try:
    from kvledger.state._sockio import recv_fill, recv_some, recvmsg_some, send_all
    COMPILED = True
except ImportError:   # the optional extension was not built: the same calls in Python
    send_all, recv_some, recvmsg_some, recv_fill = py_send_all, py_recv_some, py_recvmsg_some, py_recv_fill
    COMPILED = False
