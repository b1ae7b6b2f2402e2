"""The snapshot directory on Redis (`RedisDirectory`), shared by every entrypoint and holder.

`{prefix}snap:{key hex}` → entry (binary, `encode_entry`), `{prefix}live:{engine id}` →
incarnation, both with server-side TTLs, so no clocks of different machines are compared.
A batch lookup is one round trip on one server (a Lua script checks liveness next to the data).
On a Redis Cluster (a `redis+cluster://` URL) it is two rounds of MGETs — the entries, then the
liveness records of their holders — each one MGET per hash slot, batched per master, every master
at once (kvledger.util.redis_fanout): two round trips per master touched; the same key names, and
every key a command or script touches is one it was given. Every operation has one deadline for
all its round trips (`deadline`, kvledger.util.redis_client).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

from kvledger.state import auth
from kvledger.state.directory import DEFAULT_ENTRY_TTL_S, DEFAULT_HOLDER_TTL_S, Holder, SnapshotEntry
from kvledger.util.redis_client import deadline

log = logging.getLogger(__name__)

# --- shared, on Redis --------------------------------------------------------------

_ENTRY_HEAD = struct.Struct("<H")       # length of the holder id ("engine\0incarnation")
_ENTRY_BODY = struct.Struct("<QQdH")    # position, size, stored_at, length of the address

# One round trip for a batch: each entry (KEYS) whose holder's liveness record
# (ARGV[1] .. engine id) names the entry's incarnation, else false. Single Redis only: it
# reads keys it was not given, which Redis Cluster forbids (there lookups take two rounds of MGETs).
_LOOKUP_LUA = """
local out, live = {}, {}
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  out[i] = false
  if v and string.len(v) >= 2 then
    local n = string.byte(v, 1) + 256 * string.byte(v, 2)
    local engine, incarnation = string.match(string.sub(v, 3, 2 + n), '^(.-)%z(.*)$')
    if engine then
      if live[engine] == nil then live[engine] = redis.call('GET', ARGV[1] .. engine) end
      if live[engine] == incarnation then out[i] = v end
    end
  end
end
return out
"""

# Delete each key whose value starts with ARGV[1] (how the withdrawing holder's entries begin).
_WITHDRAW_LUA = """
local n = 0
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
    n = n + redis.call('DEL', k)
  end
end
return n
"""


# Delete KEYS[1] if it still names incarnation ARGV[1] (a restarted holder's record stays).
_RETIRE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _holder_id(holder: Holder) -> bytes:
    return f"{holder.engine_id}\x00{holder.incarnation}".encode()


def encode_entry(entry: SnapshotEntry) -> bytes:
    """Binary entry value, holder id first (so a script can match it):

      n u16 | holder id "engine\\0incarnation" (n B) | position u64 | size u64 | stored_at f64
      | m u16 | address (m B) | mac (0 or 32 B)                              little-endian
    """
    hid = _holder_id(entry.holder)
    addr = entry.holder.address.encode()
    return b"".join((_ENTRY_HEAD.pack(len(hid)), hid,
                     _ENTRY_BODY.pack(entry.position, entry.size, entry.stored_at, len(addr)), addr, entry.mac))


def decode_entry(key: bytes, raw: bytes) -> SnapshotEntry | None:
    """The entry, or None for a value that does not parse (a corrupt entry is a miss)."""
    try:
        (n,) = _ENTRY_HEAD.unpack_from(raw, 0)
        off = _ENTRY_HEAD.size
        engine_id, _, incarnation = raw[off:off + n].decode().partition("\x00")
        off += n
        position, size, stored_at, alen = _ENTRY_BODY.unpack_from(raw, off)
        off += _ENTRY_BODY.size
        if len(raw) - off - alen not in (0, auth.MAC_BYTES):
            return None
        address = raw[off:off + alen].decode()
        return SnapshotEntry(key, Holder(engine_id, address, incarnation), position, size, stored_at,
                             raw[off + alen:])
    except (struct.error, UnicodeDecodeError, AssertionError):
        return None


class RedisDirectory:
    """The directory on Redis: `{prefix}snap:{key hex}` → entry, `{prefix}live:{engine id}` → incarnation.

    Both carry server-side TTLs (entries `entry_ttl_s`, liveness `holder_ttl_s`). `url` is a
    redis:// URL, with a password (`redis://:PASSWORD@host:port/db`, Redis `requirepass`) or an
    ACL user (`redis://USER:PASSWORD@host:port/db`) where the server wants one, or a Redis Cluster's
    `redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]`; `client` may be given instead
    (a redis.Redis, or a redis-py RedisCluster: then lookups take two rounds of MGETs and
    withdrawals are one-key scripts, so no command spans two hash slots). With a url, each operation has
    one deadline, `socket_timeout_s`, for all its round trips (connect, AUTH, script load,
    commands; redis-py's retries are off), and a caller's `deadline` block can shorten it; a
    given client keeps its own per-command timeouts. A Redis fault during a lookup reads as "absent".
    """

    def __init__(self, url: str | None = None, *, client: object | None = None, prefix: str = "kvl:state:",
                 holder_ttl_s: float = DEFAULT_HOLDER_TTL_S, entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
                 socket_timeout_s: float = 2.0) -> None:
        from kvledger.util.redis_client import redis_client
        from kvledger.util.redis_cluster import is_cluster_url
        from kvledger.util.redis_fanout import FAULTS, RedisNodes

        assert (url is None) != (client is None), "give a url or a client"
        assert holder_ttl_s > 0 and entry_ttl_s > 0 and socket_timeout_s > 0
        self.holder_ttl_s = holder_ttl_s
        self.entry_ttl_s = entry_ttl_s
        self.timeout_s = socket_timeout_s
        self.prefix = prefix
        self._nodes = None  # the cluster path (kvledger.util.redis_fanout)
        if (url is not None and is_cluster_url(url)) or type(client).__name__ == "RedisCluster":
            self._nodes = RedisNodes(url, socket_timeout_s, deadlines=True, client=client)
            self._withdraw_sha = self._nodes.script(_WITHDRAW_LUA)
            self._retire_sha = self._nodes.script(_RETIRE_LUA)
        else:
            if client is None:
                client = redis_client(url, timeout_s=socket_timeout_s, deadlines=True)
            self._single = client
            self._withdraw = client.register_script(_WITHDRAW_LUA)
            self._lookup = client.register_script(_LOOKUP_LUA)
        self._errors = FAULTS
        self.faults = 0  # lookups answered "absent" because Redis failed
        self._logged: set[type] = set()

    @property
    def _r(self):  # noqa: ANN202 - redis.Redis or redis.cluster.RedisCluster: for tests and benchmarks
        return self._nodes.client() if self._nodes is not None else self._single

    def _snap(self, key: bytes) -> str:
        return f"{self.prefix}snap:{key.hex()}"

    def _live(self, engine_id: str) -> str:
        return f"{self.prefix}live:{engine_id}"

    def publish(self, entries: Sequence[SnapshotEntry]) -> None:
        if not entries:
            return
        px = int(self.entry_ttl_s * 1000)
        with deadline(self.timeout_s):
            if self._nodes is not None:
                self._each([(self._snap(e.key), ("SET", self._snap(e.key), encode_entry(e), "PX", px))
                            for e in entries])
                return
            pipe = self._single.pipeline(transaction=False)
            for e in entries:
                pipe.set(self._snap(e.key), encode_entry(e), px=px)
            pipe.execute()

    def withdraw(self, keys: Sequence[bytes], holder: Holder) -> None:
        if not keys:
            return
        hid = _ENTRY_HEAD.pack(len(_holder_id(holder))) + _holder_id(holder)  # how its entries begin
        with deadline(self.timeout_s):
            if self._nodes is not None:  # one script per key: no script spans two hash slots
                sha = self._withdraw_sha
                self._each([(self._snap(k), ("EVALSHA", sha, 1, self._snap(k), hid)) for k in keys])
            else:
                self._withdraw(keys=[self._snap(k) for k in keys], args=[hid])

    def _each(self, commands: list[tuple[str, tuple]]) -> list:
        """Cluster: run (key name, command) pairs, batched per master; raise the first fault, as one server would."""
        from kvledger.util.redis_fanout import Call, command

        replies = self._nodes.run([Call(self._nodes.slot(name), command(*cmd)) for name, cmd in commands])
        fault = next((r for r in replies if isinstance(r, BaseException)), None)
        if fault is not None:
            raise fault
        return replies

    def lookup(self, keys: Sequence[bytes]) -> list[SnapshotEntry | None]:
        if not keys:
            return []
        try:
            with deadline(self.timeout_s):
                if self._nodes is not None:
                    return self._lookup_cluster(keys)
                raws = self._lookup(keys=[self._snap(k) for k in keys], args=[f"{self.prefix}live:"])
                return [decode_entry(k, raw) if raw else None for k, raw in zip(keys, raws)]
        except self._errors as e:
            self._fault(e)
            return [None] * len(keys)

    def _fault(self, e: BaseException) -> None:
        self.faults += 1
        if type(e) not in self._logged:  # the first fault of each type, with its traceback
            self._logged.add(type(e))
            log.warning("state directory on Redis: lookup fault (counted in faults; later ones of this "
                        "type are not logged)", exc_info=e)

    def _lookup_cluster(self, keys: Sequence[bytes]) -> list[SnapshotEntry | None]:
        """Two rounds: the entries, then their holders' liveness. A master that fails costs only its
        keys (they read as absent; the lookup counts one fault)."""
        raws = self._nodes.mget([self._snap(k) for k in keys])
        entries = [decode_entry(k, raw) if isinstance(raw, bytes) else None for k, raw in zip(keys, raws)]
        engines = sorted({e.holder.engine_id for e in entries if e is not None})
        lives = self._nodes.mget([self._live(x) for x in engines]) if engines else []
        live = dict(zip(engines, lives))
        fault = next((r for r in [*raws, *lives] if isinstance(r, BaseException)), None)
        if fault is not None:
            self._fault(fault)
        return [e if e is not None and live.get(e.holder.engine_id) == e.holder.incarnation.encode() else None
                for e in entries]

    def heartbeat(self, holder: Holder) -> None:
        name, px = self._live(holder.engine_id), int(self.holder_ttl_s * 1000)
        with deadline(self.timeout_s):
            if self._nodes is not None:
                self._each([(name, ("SET", name, holder.incarnation, "PX", px))])
            else:
                self._single.set(name, holder.incarnation, px=px)

    def retire(self, holder: Holder) -> None:
        name = self._live(holder.engine_id)
        # only this incarnation's record: a restarted holder with the same id stays live
        with deadline(self.timeout_s):
            if self._nodes is not None:
                self._each([(name, ("EVALSHA", self._retire_sha, 1, name, holder.incarnation))])
            else:
                self._single.eval(_RETIRE_LUA, 1, name, holder.incarnation)

    def close(self) -> None:
        if self._nodes is not None:
            self._nodes.close()
        else:
            self._single.close()
