"""One way to open a Redis client for kvledger's shared parts (registry, index, directory).

`redis_client(url, timeout_s=...)`: every socket wait bounded by `timeout_s`, no silent retries
(a fault is the caller's to count and turn into a miss)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def redis_client(url: str, *, timeout_s: float = 2.0) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0)
