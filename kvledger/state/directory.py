"""The snapshot directory: which holder keeps the snapshot of a key, at which position.

A snapshot key is the chain key of the block that ends at the snapshot position. An
entry names its holder (engine id, state server address, and the incarnation of that
holder process), the position, the size in bytes and the time it was stored.

Liveness: a holder heartbeats (`heartbeat(holder)`), which refreshes a liveness record
with a TTL (`holder_ttl_s`). A lookup returns an entry only while its holder's liveness
record exists *and* names the same incarnation, so the entries of a holder that stopped
heartbeating — or restarted with an empty pool — read as absent at once, and their keys
expire later (`entry_ttl_s`) instead of pointing at nothing forever.

Two implementations with one interface: `MemoryDirectory` (embedded, inside the process)
and `RedisDirectory` (shared by every entrypoint; entries and liveness are Redis keys with
server-side TTLs, so no clocks of different machines are compared). Lookups are batched:
one call for many keys, one round trip to Redis whatever their number (a script checks
liveness next to the data; on Redis Cluster, two MGETs).

Authenticity: an entry carries `mac`, HMAC-SHA256 under the cluster token's directory key
over (key, engine id, incarnation, address, position, size) — `sign` makes it, `verified`
checks it. `StateLedger` signs what it publishes and treats an entry that fails as absent,
so whoever can write to Redis without the token cannot add a holder or move one elsewhere
(it can still delete entries: a miss, never a wrong answer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvledger.core import KEY_BYTES
from kvledger.state import auth

log = logging.getLogger(__name__)
DEFAULT_HOLDER_TTL_S = 10.0
DEFAULT_ENTRY_TTL_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Holder:
    """A process that keeps snapshots in its slot pool and serves them at `address` ("host:port")."""

    engine_id: str
    address: str
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        assert self.engine_id and "\x00" not in self.engine_id and "\x00" not in self.incarnation


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    key: bytes        # chain key of the block that ends at `position`
    holder: Holder
    position: int     # tokens; a multiple of the block size
    size: int         # bytes
    stored_at: float  # unix seconds, the holder's clock (informational, not covered by `mac`)
    mac: bytes = b""  # 32 B from `sign`, or empty (unsigned: `verified` is False)

    def __post_init__(self) -> None:
        assert len(self.key) == KEY_BYTES and self.position >= 0 and self.size >= 0
        assert len(self.mac) in (0, auth.MAC_BYTES)


def entry_mac(directory_key: bytes, entry: SnapshotEntry) -> bytes:
    """HMAC-SHA256 over the entry's fields; each string is length-prefixed, so no two differ only in framing."""
    h = entry.holder
    parts = [entry.key, h.engine_id.encode(), h.incarnation.encode(), h.address.encode()]
    framed = b"".join(struct.pack("<I", len(x)) + x for x in parts)
    numbers = struct.pack("<QQ", entry.position, entry.size)
    return auth.mac(directory_key, b"kvledger/snapshot-entry\x00", framed, numbers)


def sign(directory_key: bytes, entry: SnapshotEntry) -> SnapshotEntry:
    return dataclasses.replace(entry, mac=entry_mac(directory_key, entry))


def verified(directory_key: bytes, entry: SnapshotEntry | None) -> SnapshotEntry | None:
    """`entry` when its MAC is right under `directory_key`, else None (forged, moved or unsigned)."""
    if entry is None or len(entry.mac) != auth.MAC_BYTES:
        return None
    return entry if auth.same(entry.mac, entry_mac(directory_key, entry)) else None


class Directory(Protocol):
    """What every directory offers (embedded or shared)."""

    holder_ttl_s: float

    def publish(self, entries: Sequence[SnapshotEntry]) -> None: ...
    def withdraw(self, keys: Sequence[bytes], holder: Holder) -> None: ...
    def lookup(self, keys: Sequence[bytes]) -> list[SnapshotEntry | None]: ...
    def heartbeat(self, holder: Holder) -> None: ...
    def retire(self, holder: Holder) -> None: ...
    def close(self) -> None: ...


# --- embedded ----------------------------------------------------------------------

class MemoryDirectory:
    """The directory inside one process (embedded mode). Thread-safe. Times are monotonic seconds."""

    def __init__(self, holder_ttl_s: float = DEFAULT_HOLDER_TTL_S, entry_ttl_s: float = DEFAULT_ENTRY_TTL_S) -> None:
        assert holder_ttl_s > 0 and entry_ttl_s > 0
        self.holder_ttl_s = holder_ttl_s
        self.entry_ttl_s = entry_ttl_s
        self._entries: dict[bytes, tuple[SnapshotEntry, float]] = {}  # key -> (entry, expires)
        self._live: dict[str, tuple[str, float]] = {}                 # engine id -> (incarnation, expires)
        self._lock = threading.Lock()

    def publish(self, entries: Sequence[SnapshotEntry]) -> None:
        expires = time.monotonic() + self.entry_ttl_s
        with self._lock:
            for e in entries:
                self._entries[e.key] = (e, expires)

    def withdraw(self, keys: Sequence[bytes], holder: Holder) -> None:
        """Remove entries of `keys` that `holder` still holds (another holder's newer entry stays)."""
        with self._lock:
            for k in keys:
                got = self._entries.get(k)
                if got is not None and got[0].holder == holder:
                    del self._entries[k]

    def lookup(self, keys: Sequence[bytes]) -> list[SnapshotEntry | None]:
        now = time.monotonic()
        out: list[SnapshotEntry | None] = []
        with self._lock:
            for k in keys:
                got = self._entries.get(k)
                if got is None:
                    out.append(None)
                    continue
                entry, expires = got
                live = self._live.get(entry.holder.engine_id)
                if expires <= now:
                    del self._entries[k]
                    out.append(None)
                elif live is None or live[1] <= now or live[0] != entry.holder.incarnation:
                    out.append(None)
                else:
                    out.append(entry)
        return out

    def heartbeat(self, holder: Holder) -> None:
        with self._lock:
            self._live[holder.engine_id] = (holder.incarnation, time.monotonic() + self.holder_ttl_s)
            if len(self._entries) > 4096 and len(self._live) > 1:
                self._sweep()

    def retire(self, holder: Holder) -> None:
        """A holder leaving cleanly: its entries read as absent from now on."""
        with self._lock:
            live = self._live.get(holder.engine_id)
            if live is not None and live[0] == holder.incarnation:
                del self._live[holder.engine_id]

    def _sweep(self) -> None:
        """Drop entries of dead holders and expired entries (under the lock)."""
        now = time.monotonic()
        dead = [k for k, (e, exp) in self._entries.items()
                if exp <= now or (lv := self._live.get(e.holder.engine_id)) is None or lv[1] <= now
                or lv[0] != e.holder.incarnation]
        for k in dead:
            del self._entries[k]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        pass


# --- shared, on Redis --------------------------------------------------------------

_local = threading.local()


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every Redis round trip of this thread inside the block (connect, AUTH, script loads,
    commands) shares one deadline `seconds` from now; an inner block cannot extend an outer one."""
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

        raise redis.TimeoutError("directory deadline passed")
    return left


def _deadline_connection() -> type:
    """A redis-py Connection whose every socket wait is cut to the thread's `deadline`."""
    import redis

    class DeadlineConnection(redis.Connection):
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

    return DeadlineConnection


_ENTRY_HEAD = struct.Struct("<H")       # length of the holder id ("engine\0incarnation")
_ENTRY_BODY = struct.Struct("<QQdH")    # position, size, stored_at, length of the address

# One round trip for a batch: each entry (KEYS) whose holder's liveness record
# (ARGV[1] .. engine id) names the entry's incarnation, else false. Single Redis only: it
# reads keys it was not given, which Redis Cluster forbids (there lookups take two MGETs).
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
    ACL user (`redis://USER:PASSWORD@host:port/db`) where the server wants one; `client` may
    be given instead (e.g. a RedisCluster: lookups then use `mget_nonatomic`, and withdrawals
    are one-key scripts so no command spans two hash slots). With a url, each operation has
    one deadline, `socket_timeout_s`, for all its round trips (connect, AUTH, script load,
    commands; redis-py's retries are off), and a caller's `deadline` block can shorten it; a
    given client keeps its own per-command timeouts. A Redis fault during a lookup reads as "absent".
    """

    def __init__(self, url: str | None = None, *, client: object | None = None, prefix: str = "kvl:state:",
                 holder_ttl_s: float = DEFAULT_HOLDER_TTL_S, entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
                 socket_timeout_s: float = 2.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        assert (url is None) != (client is None), "give a url or a client"
        assert holder_ttl_s > 0 and entry_ttl_s > 0 and socket_timeout_s > 0
        self.holder_ttl_s = holder_ttl_s
        self.entry_ttl_s = entry_ttl_s
        self.timeout_s = socket_timeout_s
        self.prefix = prefix
        if client is None:
            pool = redis.ConnectionPool.from_url(
                url, connection_class=_deadline_connection(), socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0))
            client = redis.Redis(connection_pool=pool)
        self._r = client
        self._cluster = type(self._r).__name__ == "RedisCluster"
        self._withdraw = self._r.register_script(_WITHDRAW_LUA)
        self._lookup = self._r.register_script(_LOOKUP_LUA)
        self._errors = (redis.RedisError, OSError)
        self.faults = 0  # lookups answered "absent" because Redis failed
        self._logged: set[type] = set()

    def _snap(self, key: bytes) -> str:
        return f"{self.prefix}snap:{key.hex()}"

    def _live(self, engine_id: str) -> str:
        return f"{self.prefix}live:{engine_id}"

    def publish(self, entries: Sequence[SnapshotEntry]) -> None:
        if not entries:
            return
        px = int(self.entry_ttl_s * 1000)
        with deadline(self.timeout_s):
            pipe = self._r.pipeline(transaction=False)
            for e in entries:
                pipe.set(self._snap(e.key), encode_entry(e), px=px)
            pipe.execute()

    def withdraw(self, keys: Sequence[bytes], holder: Holder) -> None:
        if not keys:
            return
        hid = _ENTRY_HEAD.pack(len(_holder_id(holder))) + _holder_id(holder)  # how its entries begin
        with deadline(self.timeout_s):
            if self._cluster:
                pipe = self._r.pipeline(transaction=False)
                for k in keys:
                    self._withdraw(keys=[self._snap(k)], args=[hid], client=pipe)
                pipe.execute()
            else:
                self._withdraw(keys=[self._snap(k) for k in keys], args=[hid])

    def _mget(self, names: list[str]) -> list[bytes | None]:
        if self._cluster:
            return self._r.mget_nonatomic(names)
        return self._r.mget(names)

    def lookup(self, keys: Sequence[bytes]) -> list[SnapshotEntry | None]:
        if not keys:
            return []
        try:
            with deadline(self.timeout_s):
                return self._lookup_raw(keys)
        except self._errors as e:
            self.faults += 1
            if type(e) not in self._logged:  # the first fault of each type, with its traceback
                self._logged.add(type(e))
                log.warning("state directory on Redis: lookup fault (counted in faults; later ones of this "
                            "type are not logged)", exc_info=True)
            return [None] * len(keys)

    def _lookup_raw(self, keys: Sequence[bytes]) -> list[SnapshotEntry | None]:
        if not self._cluster:  # one round trip: the liveness check runs in Redis
            raws = self._lookup(keys=[self._snap(k) for k in keys], args=[f"{self.prefix}live:"])
            return [decode_entry(k, raw) if raw else None for k, raw in zip(keys, raws)]
        raws = self._mget([self._snap(k) for k in keys])
        entries = [decode_entry(k, raw) if raw is not None else None for k, raw in zip(keys, raws)]
        engines = sorted({e.holder.engine_id for e in entries if e is not None})
        if not engines:
            return entries
        live = dict(zip(engines, self._mget([self._live(x) for x in engines])))
        return [e if e is not None and live.get(e.holder.engine_id) == e.holder.incarnation.encode() else None
                for e in entries]

    def heartbeat(self, holder: Holder) -> None:
        with deadline(self.timeout_s):
            self._r.set(self._live(holder.engine_id), holder.incarnation, px=int(self.holder_ttl_s * 1000))

    def retire(self, holder: Holder) -> None:
        name = self._live(holder.engine_id)
        # only this incarnation's record: a restarted holder with the same id stays live
        with deadline(self.timeout_s):
            self._r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
                         "return 0", 1, name, holder.incarnation)

    def close(self) -> None:
        self._r.close()
