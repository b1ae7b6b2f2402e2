"""`StateLedger`: what an engine and the entrypoint use of the state ledger.

    ledger = StateLedger(spec, token="...", directory=RedisDirectory(url), strategy="memory").start()
    ledger.put(key, position, window_bytes)   # engine, after prefill / at request end (rule 4)
    ledger.positions(keys)                    # entrypoint, metadata only: swa_snapshots for decide_hit
    ledger.fetch(key)                         # engine: local pool, else pull from the holder, else disk

A ledger with `capacity_bytes=0` holds nothing and serves nothing (an entrypoint): it only
looks up and pulls. Nothing here raises on a fault of the directory, the network or the
disk: the snapshot reads as absent and the hit rule falls back (rule 8); `faults` counts,
and the first fault of each kind and exception type is logged at WARNING with its traceback.

The token (non-empty, else ValueError) never travels: it keys the state server's handshake
and the MACs of directory entries; an entry whose MAC fails reads as absent.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path

from kvledger.core import KEY_BYTES, ModelSpec
from kvledger.state import auth
from kvledger.state.client import DEFAULT_TIMEOUT_S, StateClient
from kvledger.state.directory import Directory, Holder, MemoryDirectory, SnapshotEntry, sign, verified
from kvledger.state.files import SnapshotFiles
from kvledger.state.pool import SlotPool
from kvledger.state.pull_server import StateServer
from kvledger.state.strategy import Strategy
from kvledger.util.redis_client import deadline

DEFAULT_CAPACITY_BYTES = 1 << 30
log = logging.getLogger(__name__)


class StateLedger:
    """Slot pool + directory + state server + pulls + (per strategy) snapshot files.

    Invariants: a snapshot in the pool is published in the directory under this ledger's
    holder; an evicted one is withdrawn, also when the eviction races its publish (the
    publisher re-checks the pool after publishing); `positions` never reads snapshot bytes.
    The state server's limits are `max_connections` (authenticated connections),
    `handshake_timeout_s` (to prove the token) and `idle_timeout_s` (between requests).
    """

    def __init__(self, spec: ModelSpec, *, token: str | bytes, directory: Directory | None = None,
                 strategy: Strategy | str = "memory", capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 root: str | Path | None = None, engine_id: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, serve: bool = True, pull_timeout_s: float = DEFAULT_TIMEOUT_S,
                 heartbeat: bool = True, max_connections: int = 64, handshake_timeout_s: float = 2.0,
                 idle_timeout_s: float = 30.0, directory_timeout_s: float = 2.0) -> None:
        self._dir_key = auth.derive_keys(token).directory  # ValueError for an empty token
        if not spec.has_swa:
            raise ValueError(f"{spec.name} has no sliding-window layers: it has no state to keep")
        self.spec = spec
        self.strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
        self.strategy.check(spec.block_size)
        if self.strategy.persists_any and root is None:
            raise ValueError(f"strategy {self.strategy} persists snapshots: give a root folder")
        self.directory: Directory = directory if directory is not None else MemoryDirectory()
        self.files = SnapshotFiles(root) if self.strategy.persists_any else None
        holds = self.strategy.keeps and capacity_bytes > 0
        self.pool = SlotPool.for_spec(spec, capacity_bytes) if holds else None
        self.server = StateServer(self.pool, token, host, port, max_connections=max_connections,
                                  handshake_timeout_s=handshake_timeout_s,
                                  idle_timeout_s=idle_timeout_s) if holds and serve else None
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.directory_timeout_s = directory_timeout_s  # one deadline for all of a put's directory round trips
        self.client = StateClient(token, timeout_s=pull_timeout_s)
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.holder: Holder | None = None
        self.faults: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._heartbeat = heartbeat and holds
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if self.pool is not None:
            self.pool.on_evict = self._withdraw

    # --- lifetime ----------------------------------------------------------------

    def start(self) -> StateLedger:
        if self.pool is None:
            return self
        if self.server is not None:
            self.server.start()
        self.holder = Holder(self.engine_id, self.server.address if self.server is not None else "")
        self._beat_once()
        if self._heartbeat:
            self._beat = threading.Thread(target=self._beat_loop, name="kvledger-state-heartbeat", daemon=True)
            self._beat.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(5)
        if self.holder is not None:
            try:
                self.directory.retire(self.holder)
            except Exception:  # noqa: BLE001 - its entries read as absent once its liveness expires
                self._fault("retire")
        if self.server is not None:
            self.server.stop()
        self.client.close()
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> StateLedger:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    # --- writes ------------------------------------------------------------------

    def put(self, key: bytes, position: int, data: bytes | bytearray | memoryview, tenant: str = "", *,
            extra: bool = False) -> bool:
        """Keep the snapshot taken at `position` (tokens) under `key`, the chain key of the block
        ending there, as `tenant`'s (`forget`). True when it went somewhere (pool or disk) per the strategy.
        `extra`: not where a prompt ends (rules 4′, 4″), first to be evicted from the pool (`SlotPool.put`)."""
        assert len(key) == KEY_BYTES and position > 0 and position % self.spec.block_size == 0
        kept = False
        if self.files is not None and self.strategy.persists(position):
            try:
                self.files.write(key, position, data)
                kept = True
            except OSError:
                self._fault("disk")
        if self.pool is not None and self.holder is not None:
            with deadline(self.directory_timeout_s):  # the evictions' withdraw and the publish share it
                result = self.pool.put(key, position, data, tenant, extra=extra)
                if result.stored:
                    kept = True
                    self._publish(SnapshotEntry(key, self.holder, position, memoryview(data).nbytes, time.time()))
        return kept

    def forget(self, tenant: str) -> tuple[int, int]:
        """Forget `tenant`'s snapshots this ledger holds (DESIGN rule 12): out of the pool, out of the directory, off
        the disk; (how many went, how many a reader still pins: `SlotPool.discard_tenant`). Snapshot files of keys
        the pool no longer held go with the block ledger's forget (store/forget.py), by key."""
        if self.pool is None:
            return 0, 0
        gone, pinned = self.pool.discard_tenant(tenant)
        self._withdraw(gone)
        if self.files is not None:
            for key in gone:
                self.files.remove(key)
        return len(gone), pinned

    def _publish(self, entry: SnapshotEntry) -> None:
        """Publish, then withdraw again if an eviction raced the publish: an evicting thread's
        withdraw may have reached the directory before this publish, and must still win."""
        assert self.pool is not None and self.holder is not None
        try:
            self.directory.publish([sign(self._dir_key, entry)])
        except Exception:  # noqa: BLE001 - a directory fault is a later miss, never an error here
            self._fault("directory")
        if entry.key not in self.pool:
            self._withdraw([entry.key])

    def _withdraw(self, keys: list[bytes]) -> None:
        if self.holder is None:
            return
        try:
            self.directory.withdraw(keys, self.holder)
        except Exception:  # noqa: BLE001
            self._fault("directory")

    def _fault(self, kind: str) -> None:
        """Count a caught fault; log the first of each (kind, exception type) with its traceback."""
        self.faults[kind] += 1
        exc = sys.exc_info()[1]
        what = (kind, type(exc).__name__)
        if what not in self._logged:
            self._logged.add(what)
            log.warning("state ledger %s: %s fault (counted in faults[%r]; later ones of this kind are "
                        "not logged)", self.engine_id, kind, kind, exc_info=exc is not None)

    # --- reads -------------------------------------------------------------------

    def positions(self, keys: Sequence[bytes], at: Collection[int] | None = None) -> set[int]:
        """Positions holding a snapshot, metadata only: `keys[i]` is the chain key of block i,
        so its snapshot position is (i + 1)·B. The result is `decide_hit`'s `swa_snapshots`.
        `at` limits the question to some positions (`core.snapshot_candidates`: L1 alone for a model that falls
        back, every boundary up to L1 for one that resumes exactly, rule 3′). Bound to `keys`, this is every
        CHECK's `core.SnapshotLookup`, and the one place that turns its faults into misses (rule 8;
        `core.lookup_hit` catches nothing): a directory that cannot be reached is counted and answers no
        position."""
        if not self.strategy.keeps:
            return set()
        b = self.spec.block_size
        found: set[int] = set()
        rest: list[int] = []
        wanted = range(len(keys)) if at is None else [p // b - 1 for p in sorted(at)
                                                      if p > 0 and p % b == 0 and p // b <= len(keys)]
        for i in wanted:
            k = keys[i]
            if self.pool is not None and self.pool.position(k) == (i + 1) * b:
                found.add((i + 1) * b)
            else:
                rest.append(i)
        if rest:
            try:
                entries = self.directory.lookup([keys[i] for i in rest])
            except Exception:  # noqa: BLE001
                self._fault("directory")
                entries = [None] * len(rest)
            for i, e in zip(rest, entries):
                e = verified(self._dir_key, e)
                if e is not None and e.position == (i + 1) * b:
                    found.add((i + 1) * b)
        if self.files is not None:
            for i in rest:
                pos = (i + 1) * b
                if pos not in found and self.strategy.persists(pos) and self.files.exists(keys[i]):
                    found.add(pos)
        return found

    def fetch(self, key: bytes) -> bytes | bytearray | None:
        """The snapshot's bytes: from this host's pool, else pulled from its holder, else from disk;
        None when none of them has it (or every source failed)."""
        if not self.strategy.keeps:
            return None
        if self.pool is not None:
            data = self.pool.get(key)
            if data is not None:
                return data
        entry = self._remote_entry(key)
        if entry is not None:
            got = self._pull(entry)
            if got is not None:
                return got
        if self.files is not None:
            got = self.files.read(key)
            if got is not None:
                return got[1]
        return None

    def fetch_into(self, key: bytes, out: bytearray | memoryview) -> int | None:
        """Like `fetch`, straight into `out` (an engine's state slot): the snapshot's size, or None.
        On None, `out` may hold partial bytes that must not be used."""
        if not self.strategy.keeps:
            return None
        if self.pool is not None:
            n = self.pool.read_into(key, out)
            if n is not None:
                return n
        entry = self._remote_entry(key)
        if entry is not None:
            got = self.client.pull_into(entry.holder.address, key, out)
            if got is not None and (got.size, got.position) == (entry.size, entry.position):
                return got.size
        if self.files is not None:
            found = self.files.read(key)
            if found is not None and len(found[1]) <= len(out):
                memoryview(out)[:len(found[1])] = found[1]
                return len(found[1])
        return None

    def _pull(self, entry: SnapshotEntry) -> bytearray | None:
        """The pulled bytes when they match the entry's size and position; None otherwise."""
        buf = bytearray(entry.size)
        got = self.client.pull_into(entry.holder.address, entry.key, buf)
        if got is None or (got.size, got.position) != (entry.size, entry.position):
            return None
        return buf

    def _remote_entry(self, key: bytes) -> SnapshotEntry | None:
        """The directory's entry for `key`, when its MAC is right and another holder with an address has it."""
        try:
            (entry,) = self.directory.lookup([key])
        except Exception:  # noqa: BLE001 - a directory fault is a miss
            self._fault("directory")
            return None
        entry = verified(self._dir_key, entry)
        if entry is None or entry.holder == self.holder or not entry.holder.address:
            return None
        return entry

    # --- heartbeat ---------------------------------------------------------------

    def _beat_once(self) -> None:
        assert self.holder is not None
        try:
            self.directory.heartbeat(self.holder)
        except Exception:  # noqa: BLE001 - the next beat retries; until then lookups read absent
            self._fault("heartbeat")

    def _beat_loop(self) -> None:
        interval = self.directory.holder_ttl_s / 3
        while not self._stop.wait(interval):
            self._beat_once()
