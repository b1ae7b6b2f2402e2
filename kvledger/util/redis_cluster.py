"""A private 3-master Redis Cluster on free loopback ports (tests, benchmarks, `kvledger up
--redis-cluster`), and the `redis+cluster://` URLs kvledger uses to reach a Redis Cluster.

URL: `redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]` — any master (or several, tried
in order) to learn the slot map from; there is no database number on a cluster. A plain `redis://`
URL is one Redis server, as before; a `redis+cluster://` URL is what makes the block store and the
snapshot directory use their cluster paths (every key a script touches in KEYS, one hash slot per
script, round trips grouped per node).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from urllib.parse import unquote

from kvledger.util.redis_server import RedisServer
from kvledger.util.serve_process import free_ports

SCHEME = "redis+cluster://"


@dataclass(frozen=True, slots=True)
class ClusterUrl:
    """A parsed `redis+cluster://` URL: the startup nodes and the credentials (None: none)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None


def is_cluster_url(url: str) -> bool:
    return url.startswith(SCHEME)


def parse_cluster_url(url: str) -> ClusterUrl:
    """`redis+cluster://[[user]:password@]host:port[,host:port...][/0]` → ClusterUrl; ValueError if malformed."""
    if not is_cluster_url(url):
        raise ValueError(f"not a {SCHEME} URL: {url!r}")
    rest = url[len(SCHEME):]
    rest, _, db = rest.partition("/")
    if db not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, got {url!r}")
    cred, _, hosts = rest.rpartition("@")
    user, _, password = cred.partition(":") if cred else ("", "", "")
    nodes = []
    for part in hosts.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad node {part!r} in {url!r} (want host:port)")
        nodes.append((host.strip("[]"), int(port)))
    return ClusterUrl(tuple(nodes), unquote(user) or None, unquote(password) or None)


def cluster_client(url: str, timeout_s: float, **kwargs: object):  # -> redis.cluster.RedisCluster
    """A redis-py RedisCluster for `url`: socket timeouts `timeout_s`, no retries of its own (a fault is a
    miss for the caller), slots served while another master is down; `kwargs` go to every node's client
    (e.g. `connection_class`). Connects (learns the slot map) now: redis.ConnectionError when no startup
    node answers."""
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode
    from redis.cluster import RedisCluster as Client
    from redis.retry import Retry

    from redis.exceptions import ConnectionError, RedisClusterException

    parsed = parse_cluster_url(url)
    try:
        (host, port), *more = parsed.nodes  # the first as a url: node pools then take `connection_class`
        first = f"redis://{f'[{host}]' if ':' in host else host}:{port}"
        return Client(url=first, startup_nodes=[ClusterNode(h, p) for h, p in more],
                      username=parsed.username, password=parsed.password, socket_timeout=timeout_s,
                      socket_connect_timeout=timeout_s, require_full_coverage=False, retry=Retry(NoBackoff(), 0),
                      health_check_interval=0, **kwargs)
    except RedisClusterException as e:  # not a RedisError: said as the connection fault it is
        raise ConnectionError(f"no startup node of {url} gives the slot map: {e}") from None


class RedisCluster:
    """`with RedisCluster() as c: c.url` — `masters` redis-servers with `--cluster-enabled yes` on free
    loopback ports (data in temp dirs), joined by `redis-cli --cluster create … --cluster-replicas 0`;
    ready when every node reports `cluster_state:ok`. `stop()` ends them all; `nodes[i]` is each
    node's RedisServer (`nodes[i].kill()` for fault tests). A master that dies leaves its slots
    unserved (no replicas) while the others keep serving theirs (`cluster-require-full-coverage no`).
    """

    def __init__(self, masters: int = 3, *, node_timeout_ms: int = 2000, password: str | None = None) -> None:
        assert masters >= 3, "redis-cli --cluster create wants at least 3 masters"
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed (make setup installs Debian's redis-server/redis-tools)")
        self.nodes: list[RedisServer] = []
        ports = free_ports(2 * masters)   # all different: a node's port and its cluster bus port
        for port, bus in zip(ports[::2], ports[1::2]):  # the bus port is explicit: port + 10000 may be taken
            opts = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port",
                    str(bus), "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no")
            self.nodes.append(RedisServer(port, password=password, extra_args=opts))
        self.password = password
        # redis-cli takes the password from its environment, not its command line
        self._cli_env = {**os.environ, "REDISCLI_AUTH": password} if password else None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return SCHEME + auth + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def shown_url(self) -> str:
        """`url` without the password, for logs and status lines."""
        return SCHEME + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        deadline = time.monotonic() + timeout_s
        try:
            for n in self.nodes:
                n.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            create = ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run(create, check=True, capture_output=True, timeout=max(deadline - time.monotonic(), 1),
                           env=self._cli_env)
            self._wait_ok(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, deadline: float) -> None:
        pending = list(self.nodes)
        while pending:
            out = subprocess.run(["redis-cli", "-p", str(pending[0].port), "cluster", "info"], capture_output=True,
                                 text=True, timeout=5, env=self._cli_env).stdout
            if "cluster_state:ok" in out:
                pending.pop(0)
            elif time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster not ok on port {pending[0].port} in time: {out.strip()!r}")
            else:
                time.sleep(0.05)

    def stop(self) -> None:
        for n in self.nodes:
            n.close()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
