"""The engine registry of the cluster mode, on Redis: who serves, in which role, how loaded.

    {prefix}{engines}:set        SET of engine ids
    {prefix}{engines}:e:<id>     {"info": EngineInfo, "issued": epoch s, "ttl_s": s, "mac": hex},
                                 expiring `ttl_s` after its last heartbeat

Redis is not trusted with who serves: an entry is MACed under the cluster token's registry key
(`state/auth.py`) over the id, the info, the time it was issued and its TTL. One that fails the MAC,
names another id, or is older than its own TTL (a captured entry replayed after the engine froze,
`live_at`) is absent, and logged. Whoever can write to Redis can still remove engines (deny service),
never add one, nor keep a frozen one listed longer than a live entry would be.

Both keys share the hash tag `{engines}`, so on a Redis Cluster they live in one slot and a
listing is one SMEMBERS + one MGET. An engine re-announces itself every `ttl_s / 3`; one that
dies stops doing so and leaves the listing within `ttl_s` (ids whose entry expired are pruned
from the set by the next listing). Every call has a socket timeout; a fault raises
`redis.RedisError` / `OSError` to the caller (the heartbeat logs it and tries again).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis

log = logging.getLogger("kvledger.cluster")
ROLES = ("prefill", "decode", "both")
DEFAULT_TTL_S = 2.0   # a frozen or dead engine leaves the listing within this long of its last beat
CLOCK_SKEW_S = 1.0    # an engine's clock and an entrypoint's may differ by this much (NTP keeps them within ms)
FAULT_HOLD_S = 10.0   # an engine whose store failed a read stays out of the registry this long after the last


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One engine as the entrypoints see it. Loads are counts at the last heartbeat."""

    engine_id: str
    role: str                      # "prefill" | "decode" | "both"
    url: str                       # its internal API, http://host:port
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pid: int
    draining: bool = False         # shutting down: takes no new request
    running: int = 0               # requests in the engine
    queued_prefill_tokens: int = 0  # prompt tokens admitted and not yet computed

    def __post_init__(self) -> None:
        assert self.role in ROLES, f"role must be one of {ROLES}"

    def prefills(self) -> bool:
        return self.role in ("prefill", "both") and not self.draining

    def decodes(self) -> bool:
        return self.role in ("decode", "both") and not self.draining

    @classmethod
    def from_dict(cls, d: dict) -> EngineInfo:
        """ValueError/TypeError/AssertionError for a dict that is not a sane EngineInfo."""
        d = dict(d)
        d["eos_token_ids"] = tuple(int(t) for t in d.get("eos_token_ids", ()))
        info = cls(**d)
        ints = (info.max_model_len, info.vocab_size, info.pid, info.running, info.queued_prefill_tokens)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in ints):
            raise TypeError("counts must be integers")
        assert info.max_model_len >= 1 and info.vocab_size >= 1 and min(info.running, info.queued_prefill_tokens) >= 0
        assert all(0 <= t < info.vocab_size for t in info.eos_token_ids), "eos ids lie in the vocabulary"
        assert info.url.startswith(("http://", "https://")), "an http(s) URL"
        return info


def seal(info: EngineInfo, key: bytes, issued: float, ttl_s: float) -> str:
    """The registry entry of `info`: its fields, the time it was issued (epoch s), its TTL (s: Redis expires it
    that long after `issued`), and their MAC."""
    body = json.dumps(asdict(info), separators=(",", ":"), sort_keys=True)
    stamp, ttl = repr(float(issued)), repr(float(ttl_s))
    return json.dumps({"info": body, "issued": stamp, "ttl_s": ttl, "mac": _mac(key, info.engine_id, body, stamp, ttl)})


def unseal(raw: bytes | str, engine_id: str, key: bytes, now: float) -> EngineInfo:
    """The EngineInfo of an entry stored under `engine_id`; ValueError when it is not one an engine of this
    cluster issued for that id, is not `live_at` `now` (epoch s), or does not parse."""
    d = json.loads(raw)
    body, issued, ttl, tag = str(d["info"]), str(d["issued"]), str(d["ttl_s"]), str(d["mac"])
    if not hmac.compare_digest(tag, _mac(key, engine_id, body, issued, ttl)):
        raise ValueError("its MAC is wrong: not written by an engine of this cluster")
    if not live_at(float(issued), float(ttl), now):
        raise ValueError(f"issued {now - float(issued):.1f} s ago with a TTL of {float(ttl):g} s "
                         f"(+ {CLOCK_SKEW_S:g} s of clock skew): a replayed entry")
    info = EngineInfo.from_dict(json.loads(body))
    if info.engine_id != engine_id:
        raise ValueError(f"it names engine {info.engine_id!r}")
    return info


def live_at(issued: float, ttl_s: float, now: float) -> bool:
    """Whether an entry issued at `issued` with TTL `ttl_s` could still be in Redis at `now` (all in seconds;
    `issued` and `now` from two machines' clocks): −CLOCK_SKEW_S ≤ now − issued ≤ ttl_s + CLOCK_SKEW_S. Redis
    drops an entry `ttl_s` after its beat, so a genuine one is never read older; an older one was put back.
    NaN anywhere is False."""
    return -CLOCK_SKEW_S <= now - issued <= ttl_s + CLOCK_SKEW_S


def _mac(key: bytes, engine_id: str, body: str, issued: str, ttl_s: str) -> str:
    parts = (b"kvledger/registry-entry/2", engine_id.encode(), body.encode(), issued.encode(), ttl_s.encode())
    return hmac.digest(key, b"\0".join(parts), "sha256").hex()


class Registry:
    """`key`: the cluster token's registry key (`derive_keys(token).registry`)."""

    def __init__(self, client: redis.Redis, key: bytes, *, prefix: str = "kvl:", ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        assert ttl_s > 0 and len(key) == 32
        self.redis, self.key, self.clock = client, key, clock
        self.refused: set[str] = set()   # ids whose entry failed `unseal` (logged once each)
        self.set_key = f"{prefix}{{engines}}:set"
        self.entry_prefix = f"{prefix}{{engines}}:e:"
        self.ttl_ms = int(ttl_s * 1000)

    @classmethod
    def from_url(cls, url: str, key: bytes, *, timeout_s: float = 2.0, **kw: Any) -> Registry:
        from kvledger.util.redis_client import redis_client

        return cls(redis_client(url, timeout_s=timeout_s), key, **kw)

    def announce(self, info: EngineInfo) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(self.set_key, info.engine_id)
        entry = seal(info, self.key, self.clock(), self.ttl_ms / 1000)
        pipe.set(self.entry_prefix + info.engine_id, entry, px=self.ttl_ms)
        pipe.execute()

    def withdraw(self, engine_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(self.set_key, engine_id)
        pipe.delete(self.entry_prefix + engine_id)
        pipe.execute()

    def members(self) -> list[EngineInfo]:
        """Live engines, sorted by id; entries that fail `unseal` are skipped (and logged)."""
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in self.redis.smembers(self.set_key))
        if not ids:
            return []
        raws = self.redis.mget([self.entry_prefix + i for i in ids])
        out, gone, now = [], [], self.clock()
        for engine_id, raw in zip(ids, raws):
            if raw is None:
                gone.append(engine_id)
                continue
            try:
                out.append(unseal(raw, engine_id, self.key, now))
            except (ValueError, TypeError, KeyError, AssertionError) as e:
                if engine_id not in self.refused:   # once per id: the entrypoint lists every poll
                    log.warning("registry entry of %r refused: %s", engine_id[:64], e)
                    self.refused.add(engine_id[:64])
        if gone:
            self.redis.srem(self.set_key, *gone)
        return out


class Heartbeat:
    """Re-announces `info()` every ttl/3 seconds on a daemon thread until `stop()`; then withdraws.

    Before each announce it asks `fault()` (the engine's store: `BlockLedger.read_fault`). While that
    names a fault, and for `hold_s` after the last one, the engine is withdrawn instead: out of the
    registry, so no entrypoint routes to it (`fault_reason` says why), back once its store reads again."""

    def __init__(self, registry: Registry, info: Callable[[], EngineInfo],
                 fault: Callable[[], str | None] = lambda: None, hold_s: float = FAULT_HOLD_S) -> None:
        self.registry, self.info, self.fault, self.hold_s = registry, info, fault, hold_s
        self.fault_reason: str | None = None   # why it is out of the registry; None: it is in
        self._out_until = 0.0                   # monotonic seconds: out of the registry until then
        self._lock = threading.Lock()           # beats come from the thread and from `drain`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvledger-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.registry.announce(self.info())   # raises: an engine that cannot register does not start
        self._thread.start()
        return self

    def beat(self) -> None:
        """Announce now (a state change such as draining should not wait for the next beat), or withdraw
        while the store is at fault."""
        with self._lock:
            try:
                if self._out():
                    self.registry.withdraw(self.info().engine_id)
                else:
                    self.registry.announce(self.info())
            except (redis.RedisError, OSError) as e:
                log.warning("heartbeat failed: %s", e)

    def _out(self) -> bool:
        why, now = self.fault(), time.monotonic()
        engine = self.info().engine_id
        if why is not None:
            if self.fault_reason is None:
                log.warning("engine %s leaves the registry: %s", engine, why)
            self.fault_reason, self._out_until = why, now + self.hold_s
        if self.fault_reason is not None and now >= self._out_until:
            log.warning("engine %s rejoins the registry: its store reads again", engine)
            self.fault_reason = None
        return self.fault_reason is not None

    def _run(self) -> None:
        while not self._stop.wait(self.registry.ttl_ms / 3000):
            self.beat()

    def stop(self, withdraw: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if withdraw:
            try:
                self.registry.withdraw(self.info().engine_id)
            except (redis.RedisError, OSError) as e:
                log.warning("could not withdraw from the registry: %s", e)
