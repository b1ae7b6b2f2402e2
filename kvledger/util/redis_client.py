"""One way to open a Redis client for kvledger's shared parts (registry, index, directory).

`redis_client(url, timeout_s=...)`: every socket wait bounded by `timeout_s`, no silent retries
(a fault is the caller's to count and turn into a miss). A `redis+cluster://` URL
(kvledger.util.redis_cluster) gives a redis-py RedisCluster: then every command and pipeline must
keep to one hash slot (a hash tag, as the engine registry's `{engines}`); it learns the slot map
when opened (redis.ConnectionError when no startup node answers).

`deadlines=True` adds one more bound: inside a `deadline(seconds)` block, every round trip of that
thread (connect, AUTH, script loads, commands) shares one deadline. It works on every transport a
URL names — `redis://` (TCP), `rediss://` (TLS), `unix://` (a socket path) and a cluster's nodes —
because the deadline is a mixin over the connection class redis-py picks for the URL.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator

from kvledger.util.redis_cluster import cluster_client, is_cluster_url

_local = threading.local()
REDIS_URL_ENV = "KVLEDGER_REDIS_URL"   # the default of --redis-url: a URL with a password stays off command lines


def shown_url(url: str) -> str:
    """`url` without its credentials (`redis://:PASSWORD@host` → `redis://host`): what logs, errors and stats
    print. Every URL kvledger prints goes through this."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"


def redis_client(url: str, *, timeout_s: float = 2.0, deadlines: bool = False):  # -> redis.Redis | RedisCluster
    """A client for `url` with socket timeouts `timeout_s` and no retries; with `deadlines`, its
    connections also honour this thread's `deadline` block. Imports redis only when called."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if is_cluster_url(url):
        extra = {"connection_class": deadline_connection(redis.Connection)} if deadlines else {}
        return cluster_client(url, timeout_s, **extra)
    extra = {"connection_class": deadline_connection(_transport(url))} if deadlines else {}
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0, **extra)


def _transport(url: str) -> type:
    """The connection class redis-py uses for `url`: Connection, SSLConnection or UnixDomainSocketConnection."""
    import redis
    from redis.connection import parse_url

    return parse_url(url).get("connection_class", redis.Connection)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every Redis round trip of this thread inside the block (on clients opened with `deadlines=True`)
    shares one deadline `seconds` from now; an inner block cannot extend an outer one."""
    outer = getattr(_local, "deadline", None)
    _local.deadline = time.monotonic() + seconds if outer is None else min(outer, time.monotonic() + seconds)
    try:
        yield
    finally:
        _local.deadline = outer


def _left() -> float | None:
    """Seconds left to this thread's deadline (None when there is none); redis TimeoutError when past."""
    end = getattr(_local, "deadline", None)
    if end is None:
        return None
    left = end - time.monotonic()
    if left <= 0:
        import redis

        raise redis.TimeoutError("deadline passed")
    return left


class _DeadlineMixin:
    """Cuts every socket wait of a redis-py connection to the thread's `deadline` (none: its own timeouts)."""

    def _connect(self):  # noqa: ANN202 - redis-py's signature
        left = _left()
        if left is None:
            return super()._connect()
        saved = self.socket_connect_timeout, self.socket_timeout
        self.socket_connect_timeout = min(saved[0] or left, left)
        self.socket_timeout = min(saved[1] or left, left)
        try:
            return super()._connect()
        finally:
            self.socket_connect_timeout, self.socket_timeout = saved

    def _cut(self) -> None:
        left = _left()
        if left is not None and self._sock is not None:
            self._sock.settimeout(min(self.socket_timeout or left, left))

    def send_packed_command(self, command, check_health=True):  # noqa: ANN001, ANN202
        self._cut()
        return super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        self._cut()
        return super().read_response(*args, **kwargs)


@functools.cache
def deadline_connection(base: type) -> type:
    """`base` (a redis-py connection class) with `_DeadlineMixin`; one class per base, so pools compare equal."""
    return type(f"Deadline{base.__name__}", (_DeadlineMixin, base), {})
