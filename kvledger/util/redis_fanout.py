"""Batches of Redis commands sent to one Redis server, or spread over the masters of a Redis Cluster
by hash slot: one round trip per node touched, every node's batch on the wire before any reply is
read (so the nodes work at the same time), a node's fault confined to that node's commands.

`RedisNodes(url)`: `redis://…` is one server; `redis+cluster://…` (kvledger.util.redis_cluster) a
cluster, whose slot map is learned on first use (and again after a MOVED reply). Commands are
RESP-encoded here (`command`, `script_call`): redis-py's encoder costs ~1 µs per argument, too much
for a CHECK of 8,192 keys; names of one length are joined in one pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis
import redis.cluster
from redis.crc import key_slot

from kvledger.util.redis_client import redis_client, shown_url
from kvledger.util.redis_cluster import is_cluster_url

log = logging.getLogger("kvledger.redis")

FAULTS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)  # RedisClusterException: no slot map
FORGET_S = 5.0  # seconds between two re-learnings of the slot map after connection faults
BIG = 1 << 16  # an argument at least this long travels as its own buffer (not copied into the batch)

Wire = list[bytes | memoryview]


class Call(NamedTuple):
    """One command: the hash slot that routes it (ignored on a single server) and its RESP bytes."""

    slot: int
    wire: Wire


def _arg(a: bytes | memoryview | str | int | float) -> bytes | memoryview:
    if isinstance(a, (bytes, memoryview)):
        return a
    return str(a).encode()


def _bulk(a: bytes | memoryview | str | int | float) -> bytes:
    if type(a) is not bytes:
        a = _arg(a)
        return b"$%d\r\n%b\r\n" % (len(a) if isinstance(a, bytes) else a.nbytes, a)
    return b"$%d\r\n%b\r\n" % (len(a), a)


def _coalesce(pieces: Wire) -> Wire:
    """Runs of small pieces joined into one buffer (one sendall each), big ones kept as they are."""
    out: Wire = []
    run: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, bytes) and len(piece) < BIG:
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run))
    return out


def command(*args: bytes | memoryview | str | int | float) -> Wire:
    """One command as RESP: `command("HMGET", name, "m", "d")`; a big argument is not copied."""
    out: Wire = []
    head = [b"*%d\r\n" % len(args)]
    for a in map(_arg, args):
        n = a.nbytes if isinstance(a, memoryview) else len(a)
        if n >= BIG:
            out += [b"".join(head) + b"$%d\r\n" % n, a]
            head = [b"\r\n"]
        else:
            head.append(b"$%d\r\n%b\r\n" % (n, a))
    return [*out, b"".join(head)]


def script_call(sha: str, names: Sequence[bytes], *argv: bytes | str | int, head: bytes = b"") -> Wire:
    """`EVALSHA sha len(names) *(head + name) *argv`. Names of one length are joined in one pass, the
    common `head` (a key prefix) with them, so the CHECK of 8,192 keys builds no name one by one."""
    lengths = set(map(len, names))
    if len(lengths) > 1:
        return command("EVALSHA", sha, len(names), *[head + x for x in names], *argv)
    size = len(head) + (lengths.pop() if lengths else 0)
    sep = b"\r\n$%d\r\n%b" % (size, head)
    body = b"$%d\r\n%b" % (size, head) + sep.join(names) + b"\r\n" if names else b""
    top = b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n" % (3 + len(names) + len(argv), len(sha), sha.encode())
    top += _bulk(b"%d" % len(names))
    return [top + body + b"".join(map(_bulk, argv))]


class RedisNodes:
    """Where a batch goes: the one server of a `redis://` URL, or the master serving each call's slot."""

    def __init__(self, url: str | None, timeout_s: float, *, deadlines: bool = False, client: Any = None) -> None:
        """`url`, or `client` (a redis.Redis or redis.cluster.RedisCluster of the caller's, kept as it is).
        `deadlines`: a client opened from `url` honours `kvledger.util.redis_client.deadline` blocks."""
        assert (url is None) != (client is None), "give a url or a client"
        self.url = url or repr(client)
        self.timeout_s = timeout_s
        self.cluster = is_cluster_url(url) if url else isinstance(client, redis.cluster.RedisCluster)
        self.scripts: dict[str, bytes] = {}  # sha → body, loaded again on a node that answers NOSCRIPT
        self._deadlines = deadlines
        self._client: Any = client
        self._given = client is not None
        self._forgot = -FORGET_S
        self._warned = False
        self._slot_node: dict[int, redis.Redis] = {}  # slot → master, for the client `_slot_node_of`
        self._slot_node_of: Any = None
        if not self.cluster and client is None:
            self._client = redis_client(url, timeout_s=timeout_s, deadlines=deadlines)

    def script(self, body: str) -> str:
        """Register a Lua script; its sha1 (for `script_call`)."""
        sha = hashlib.sha1(body.encode()).hexdigest()
        self.scripts[sha] = body.encode()
        return sha

    def client(self) -> Any:
        """redis.Redis (one server) or redis.cluster.RedisCluster (learning the slot map now if it must)."""
        if self._client is None:
            self._client = redis_client(self.url, timeout_s=self.timeout_s, deadlines=self._deadlines)
        return self._client

    def masters(self) -> list[redis.Redis]:
        """One plain client per master (SCAN, INFO, PING go to each)."""
        c = self.client()
        if not self.cluster:
            return [c]
        return [c.get_redis_connection(n) for n in c.get_primaries()]

    def slot(self, name: bytes | str) -> int:
        """The hash slot of a key name (0 on one server)."""
        return key_slot(name.encode() if isinstance(name, str) else name) if self.cluster else 0

    def mget(self, names: Sequence[bytes | str]) -> list[Any]:
        """GET of each name: one MGET per hash slot, one round trip per node touched; a failed node's
        names give its exception."""
        by_slot: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            by_slot.setdefault(self.slot(name), []).append(i)
        groups = list(by_slot.items())
        out: list[Any] = [None] * len(names)
        for (_, idx), reply in zip(groups, self.run([Call(s, command("MGET", *[names[i] for i in idx]))
                                                    for s, idx in groups])):
            for j, i in enumerate(idx):
                out[i] = reply if isinstance(reply, BaseException) else reply[j]
        return out

    def node_of(self, slot: int) -> redis.Redis:
        c = self.client()
        if not self.cluster:
            return c
        node = self._slot_node.get(slot) if self._slot_node_of is c else None
        if node is None:
            if self._slot_node_of is not c:  # a new slot map: the old answers may be stale
                self._slot_node, self._slot_node_of = {}, c
            node = self._slot_node[slot] = c.get_redis_connection(c.nodes_manager.get_node_from_slot(slot))
        return node

    def run(self, calls: Sequence[Call]) -> list[Any]:
        """The replies in order; a reply that is an error, or every reply of a node that failed, is the
        exception (never raised). One round trip per node touched (two where a script was not loaded)."""
        out: list[Any] = [None] * len(calls)
        groups: dict[int, tuple[redis.Redis, list[int]]] = {}
        try:
            for i, call in enumerate(calls):
                node = self.node_of(call.slot)
                groups.setdefault(id(node), (node, []))[1].append(i)
        except FAULTS as e:  # no slot map (no startup node answers) or a slot no master serves
            self._forget(e)
            return [e] * len(calls)
        sent = [(node, idx, self._send(node, [calls[i].wire for i in idx])) for node, idx in groups.values()]
        for node, idx, conn in sent:  # every batch is on the wire: read them in turn
            replies = self._read(node, conn, len(idx))
            again = [j for j, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
            if again:  # the node restarted or flushed its scripts: load them, run those calls once more
                retry = self._load_and_run(node, [calls[idx[j]].wire for j in again])
                for j, r in zip(again, retry):
                    replies[j] = r
            for i, r in zip(idx, replies):
                out[i] = r
        for e in {type(r): r for r in out if isinstance(r, BaseException)}.values():
            self._forget(e)
        return out

    def _send(self, node: redis.Redis, wires: list[Wire]) -> Any:
        try:
            conn = node.connection_pool.get_connection()  # connects if it must; the pool keeps a failed one
        except FAULTS as e:
            return e
        try:
            conn.send_packed_command(_coalesce([piece for w in wires for piece in w]), check_health=False)
        except FAULTS as e:
            node.connection_pool.release(conn)
            return e
        return conn

    def _read(self, node: redis.Redis, conn: Any, n: int) -> list[Any]:
        if isinstance(conn, BaseException):
            return [conn] * n
        replies: list[Any] = []
        try:
            for _ in range(n):
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as e:
                    replies.append(e)
        except FAULTS as e:
            conn.disconnect()
            replies += [e] * (n - len(replies))
        finally:
            node.connection_pool.release(conn)
        return replies

    def _load_and_run(self, node: redis.Redis, wires: list[Wire]) -> list[Any]:
        try:
            for body in self.scripts.values():
                node.script_load(body)
        except FAULTS as e:
            return [e] * len(wires)
        return self._read(node, self._send(node, wires), len(wires))

    def _forget(self, e: BaseException) -> None:
        """After a fault, a cluster learns its slot map again on the next call (a node may have moved):
        at once after MOVED / ASK, at most every FORGET_S after a connection fault (a dead node stays dead).
        The old client is dropped, not closed: another thread may be reading from its connections."""
        moved = isinstance(e, (redis.exceptions.MovedError, redis.exceptions.AskError))
        if not self.cluster and (moved or isinstance(e, redis.exceptions.ClusterCrossSlotError)) and not self._warned:
            self._warned = True  # a redis:// URL naming one node of a cluster: every key is a miss
            log.warning("%s answers %r: it is a Redis Cluster node; give a redis+cluster:// URL", shown_url(self.url),
                        str(e))
        if isinstance(e, redis.ResponseError) and not moved:
            return  # an ordinary error reply: the map is fine
        if not moved and time.monotonic() - self._forgot < FORGET_S:
            return
        if self.cluster and self._client is not None:
            self._forgot = time.monotonic()
            log.debug("Redis Cluster %s: %s; slot map to be learned again", shown_url(self.url), e)
            self._slot_node_of = None
            if not self._given:
                self._client = None
            else:  # the caller's client: ask it to learn the map again, now
                with contextlib.suppress(*FAULTS):
                    self._client.nodes_manager.initialize()

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(*FAULTS):
                self._client.close()
        if self.cluster and not self._given:
            self._client = None
