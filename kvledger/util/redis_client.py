"""One way to open a Redis client for kvledger's shared parts (registry, index, directory).

`redis_client(url, timeout_s=...)`: every socket wait bounded by `timeout_s`, no silent retries
(a fault is the caller's to count and turn into a miss). A `redis+cluster://` URL
(kvledger.util.redis_cluster) gives a redis-py RedisCluster: then every command and pipeline must
keep to one hash slot (a hash tag, as the engine registry's `{engines}`); it learns the slot map
when opened (redis.ConnectionError when no startup node answers)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvledger.util.redis_cluster import cluster_client, is_cluster_url


def redis_client(url: str, *, timeout_s: float = 2.0):  # -> redis.Redis | redis.cluster.RedisCluster
    if is_cluster_url(url):
        return cluster_client(url, timeout_s)
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), health_check_interval=0)
