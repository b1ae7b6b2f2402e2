"""The snapshot directory: which holder keeps the snapshot of a key, at which position.

A snapshot key is the chain key of the block that ends at the snapshot position. An
entry names its holder (engine id, state server address, and the incarnation of that
holder process), the position, the size in bytes and the time it was stored.

Liveness: a holder heartbeats (`heartbeat(holder)`), which refreshes a liveness record
with a TTL (`holder_ttl_s`). A lookup returns an entry only while its holder's liveness
record exists *and* names the same incarnation, so the entries of a holder that stopped
heartbeating — or restarted with an empty pool — read as absent at once, and their keys
expire later (`entry_ttl_s`) instead of pointing at nothing forever.

Two implementations with one interface: `MemoryDirectory` (embedded, inside the process,
here) and `RedisDirectory` (`redis_directory.py`; shared by every entrypoint; entries and liveness are Redis keys with
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

import dataclasses
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvledger.core import KEY_BYTES
from kvledger.state import auth

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
