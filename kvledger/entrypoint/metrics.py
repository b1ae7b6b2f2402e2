"""`/metrics`: Prometheus metrics of `kvledger serve` (prometheus_client, one registry per server).

Names follow Prometheus' conventions (base units, `_total` on counters). Token counts are per
tenant namespace (the key file's, before any cache salt) and hit kind (`core.HitKind`, as the
engine reports what it actually used: "snapshot", "fallback", "replay", "full", "miss").

Misses are counted in blocks, by cause:
- `absent`: at CHECK, full blocks under the hit cap that the index did not hold (the index
  forgets an expired block at lookup, so a block past its TTL counts here too);
- `load_failed`: blocks the CHECK promised but the engine could not load (corrupt, truncated or
  unreachable: rule 8, recomputed and reported honestly in `cached_tokens`).
The store's read faults are `kvledger_store_read_misses_total{cause}` (absent, corrupt,
unreachable): those of this process's store, plus those the engines' fetcher processes saw while
reading hit blocks (reported per request in `RequestUsage.fetch_misses`). The store's size comes
from a scan of its index (seconds at a million blocks), so a scrape never runs one itself: it reads
the last figures of `StoreFigures` (at most STATS_EVERY_S old, plus one scan), and the counters live.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Iterator

from kvledger.core import tenant_of
from kvledger.engine.api import RequestUsage
from kvledger.engine.engine_registry import ROLES, EngineInfo
from kvledger.store.backend import StoreStats
from kvledger.util.output import interrupts_held

with interrupts_held():  # this module is the one that imports prometheus_client: see `interrupts_held`
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

EXPOSITION_TYPE = CONTENT_TYPE_LATEST   # the Content-Type of `exposition`
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FETCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
STATS_EVERY_S = 10.0   # store figures in /metrics: a scrape that finds them older starts a scan
STATS_WAIT_S = 0.5     # ... and waits this long for it before it serves the older figures


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry's figures in Prometheus' text format (`EXPOSITION_TYPE`); its collectors may read the store's
    last scan, so the server calls it off its event loop."""
    return generate_latest(registry)


class StoreFigures:
    """The store's statistics for `/metrics`, scanned in the background, one scan at a time.

    A scrape (`latest()`) that finds the last scan older than `every_s` seconds (or none) starts one on a
    thread of its own, unless one runs, and waits up to `wait_s` seconds for it; every other scrape serves
    the last figures at once. So N concurrent scrapes cost at most one scan, a scrape waits at most `wait_s`
    on one, and the figures are at most `every_s` + one scan old. `counters` (cheap, exact: misses,
    evictions) replace the scanned ones at each scrape when given."""

    def __init__(self, scan: Callable[[], StoreStats | None], counters: Callable[[], dict[str, int]] | None = None,
                 *, every_s: float = STATS_EVERY_S, wait_s: float = STATS_WAIT_S) -> None:
        assert every_s >= 0 and wait_s >= 0
        self.scan, self.counters, self.every_s, self.wait_s = scan, counters, every_s, wait_s
        self._lock = threading.Lock()
        self._figures: StoreStats | None = None
        self._scanned_at = -float("inf")          # time.monotonic() when the last scan started
        self._running: threading.Event | None = None   # set when the scan in flight ends
        self.scans = 0                            # scans started (a test counts them)

    def latest(self) -> StoreStats | None:
        started = self._start_if_stale()
        if started is not None:
            started.wait(self.wait_s)
        figures = self._figures
        if figures is None or self.counters is None:
            return figures
        return dataclasses.replace(figures, counters=self.counters())

    def _start_if_stale(self) -> threading.Event | None:
        """The event of the scan this call started, or None (figures fresh, or a scan already runs)."""
        with self._lock:
            if self._running is not None or time.monotonic() - self._scanned_at < self.every_s:
                return None
            self._running, self._scanned_at = threading.Event(), time.monotonic()
            self.scans += 1
            done = self._running
        threading.Thread(target=self._scan, args=(done,), name="kvledger-store-stats", daemon=True).start()
        return done

    def _scan(self, done: threading.Event) -> None:
        try:
            figures = self.scan()
        except Exception:  # noqa: BLE001 - a scrape never fails on a store fault (rule 8): keep the last figures
            figures = None
        with self._lock:
            if figures is not None:
                self._figures = figures
            self._running = None
        done.set()


def public_namespace(known: set[str] | None) -> Callable[[str], str]:
    """The label of a store namespace in `/metrics`: its tenant's namespace (`core.tenant_of`: salts dropped) when
    that is one the server knows (the key file's, which request metrics show already; `default` when open),
    else a digest of it: the store may hold namespaces of other writers (a vLLM connector's cache salts), and a
    label must not spell a name nobody published."""
    def label(namespace: str) -> str:
        tenant = tenant_of(namespace)
        if known is None or tenant in known:
            return tenant
        return "sha256:" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    return label


class ServeMetrics:
    def __init__(self, stats: Callable[[], StoreStats | None],
                 counters: Callable[[], dict[str, int]] | None = None,
                 public: Callable[[str], str] = tenant_of) -> None:
        """`stats`: a scan of the store (`BlockLedger.stats`, run by `StoreFigures`); `counters`: its live
        event counters; `public`: a store namespace's label (`public_namespace`; default: its tenant's)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvledger_requests", "Finished generation requests", ["namespace", "hit_kind"],
                                registry=r)
        self.prompt_tokens = Counter("kvledger_prompt_tokens", "Prompt tokens", ["namespace"], registry=r)
        self.hit_tokens = Counter("kvledger_prompt_cache_hit_tokens", "Prompt tokens served from the cache",
                                  ["namespace", "hit_kind"], registry=r)
        self.miss_tokens = Counter("kvledger_prompt_cache_miss_tokens", "Prompt tokens computed",
                                   ["namespace", "hit_kind"], registry=r)
        self.prompt_miss_tokens = Counter("kvledger_prompt_miss_tokens", "Prompt tokens computed, by why they were "
                                          "not served from the cache (cold, diverged, expired, evicted, load_failed, "
                                          "snapshot_missing, tail)", ["namespace", "cause"], registry=r)
        self.generation_tokens = Counter("kvledger_generation_tokens", "Generated tokens", ["namespace"],
                                         registry=r)
        self.ttft = Histogram("kvledger_time_to_first_token_seconds", "Arrival to first token, by cache outcome",
                              ["cache"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvledger_inter_token_latency_seconds", "Time between two streamed tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.fetch_bytes = Counter("kvledger_fetch_bytes", "Block bytes loaded from the store for hits", registry=r)
        self.fetch_seconds = Histogram("kvledger_fetch_seconds", "Time to load a request's hit blocks",
                                       buckets=FETCH_BUCKETS, registry=r)
        self.miss_blocks = Counter("kvledger_cache_miss_blocks", "Blocks under the hit cap not served, by cause",
                                   ["cause"], registry=r)
        self.errors = Counter("kvledger_errors", "Requests answered with an error, by kind", ["kind"], registry=r)
        self.running = Gauge("kvledger_requests_running", "Requests in the engine now", registry=r)
        self.legs = Counter("kvledger_engine_legs", "Engine legs of requests (cluster mode): whole, prefill, "
                            "decode, continue", ["kind", "engine", "hit_kind"], registry=r)
        self.leg_cached_tokens = Counter("kvledger_engine_leg_cached_tokens", "Tokens a leg did not compute, by "
                                         "where they came from (device cache or the ledgers)", ["kind", "source"],
                                         registry=r)
        self.preemptions = Counter("kvledger_engine_preemptions", "Requests preempted by recompute in an engine "
                                   "(the pool ran out of blocks; each preemption counts once)", registry=r)
        self.engines = Gauge("kvledger_engines", "Engines in the registry (cluster mode), by role", ["role"],
                             registry=r)
        self.engine_restarts = Counter("kvledger_engine_restarts", "Engines seen back in the registry as a new "
                                       "process (a supervisor restarted them)", ["engine"], registry=r)
        self._engine_pids: dict[str, int] = {}   # engine id → the pid it last registered with
        self.fetch_misses: dict[str, int] = {}   # cause → blocks the fetchers missed (read_misses)
        self.store = StoreFigures(stats, counters)
        r.register(StoreCollector(self.store.latest, self.fetch_misses, public))

    def leg(self, kind: str, engine: str, usage: RequestUsage | None) -> None:
        self.legs.labels(kind, engine, usage.hit_kind if usage is not None else "broken").inc()
        if usage is not None:
            self.leg_cached_tokens.labels(kind, "device").inc(usage.device_cached_tokens)
            self.leg_cached_tokens.labels(kind, "store").inc(usage.cached_tokens - usage.device_cached_tokens)

    def engines_listed(self, members: list[EngineInfo]) -> None:
        """One listing of the registry: engines by role, and a restart for each id that comes back with another
        pid (a restart on the same machine; one id moved to another machine counts too)."""
        for role in ROLES:
            self.engines.labels(role).set(sum(1 for e in members if e.role == role))
        for e in members:
            if self._engine_pids.get(e.engine_id, e.pid) != e.pid:
                self.engine_restarts.labels(e.engine_id).inc()
            self._engine_pids[e.engine_id] = e.pid

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def fetcher_misses(self, misses: dict[str, int]) -> None:
        """Read misses a fetcher process counted for one request (its store's counters are not ours)."""
        for cause, n in misses.items():
            self.fetch_misses[cause] = self.fetch_misses.get(cause, 0) + n


class StoreCollector(Collector):
    """The block ledger's size and upkeep, from `stats()` at each scrape (`StoreFigures.latest`: no scan).

    Bytes per class and namespace are the index's own totals (store/quota.py's buckets); for a store that keeps
    none, the live bytes split in proportion to blocks (exact when all blocks have one size, as for one model).
    Namespaces are labelled by `public` (`public_namespace`); guarantees are those the store keeps."""

    def __init__(self, stats: Callable[[], StoreStats | None], fetch_misses: dict[str, int] | None = None,
                 public: Callable[[str], str] = tenant_of) -> None:
        self.stats = stats
        self.fetch_misses = fetch_misses if fetch_misses is not None else {}   # read, never written, here
        self.public = public

    def _by_tenant(self, counts: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for ns, n in counts.items():
            label = self.public(ns)
            out[label] = out.get(label, 0) + n
        return out

    def collect(self) -> Iterator:
        st = self.stats()
        if st is None:
            return
        per_block = st.live_bytes / st.blocks if st.blocks else 0.0
        yield from _by_label("kvledger_store_blocks", "Live blocks in the store", "ttl_class", st.per_class, 1.0)
        exact = bool(st.class_bytes or st.namespace_bytes) or not st.blocks
        yield from _by_label("kvledger_store_bytes", "Live block bytes in the store", "ttl_class",
                             st.class_bytes if exact else st.per_class, 1.0 if exact else per_block)
        tenants = self._by_tenant(st.per_namespace)
        yield from _by_label("kvledger_store_namespace_blocks", "Live blocks by tenant namespace", "namespace",
                             tenants, 1.0)
        yield from _by_label("kvledger_store_namespace_bytes", "Live block bytes by tenant namespace", "namespace",
                             self._by_tenant(st.namespace_bytes) if exact else tenants, 1.0 if exact else per_block)
        guarantees = st.guarantees or {}
        yield from _by_label("kvledger_store_namespace_guarantee_bytes", "Bytes of the store guaranteed to a tenant "
                             "namespace (--quota, --api-keys)", "namespace",
                             self._by_tenant(guarantees.get("namespaces", {})), 1.0)
        yield from _by_label("kvledger_store_class_guarantee_bytes", "Bytes of the store guaranteed to a TTL class "
                             "(--quota)", "ttl_class", dict(guarantees.get("classes", {})), 1.0)
        if st.capacity_bytes is not None:
            cap = GaugeMetricFamily("kvledger_store_capacity_bytes", "Live block bytes past which puts evict")
            cap.add_metric([], st.capacity_bytes)
            yield cap
        disk = GaugeMetricFamily("kvledger_store_disk_bytes", "Bytes the store occupies")
        disk.add_metric([], st.disk_bytes)
        yield disk
        c = st.counters
        yield _counter("kvledger_store_evictions", "Blocks evicted for capacity", c.get("gc_evicted", 0))
        yield _counter("kvledger_store_expirations", "Blocks removed after their TTL", c.get("gc_expired", 0))
        yield _counter("kvledger_store_quota_overrides", "Blocks evicted from within a guarantee because every "
                       "namespace was within its own (guarantees over-subscribed)", c.get("quota_overrides", 0))
        misses = CounterMetricFamily("kvledger_store_read_misses", "Store reads in this process that missed",
                                     labels=["cause"])
        fetched = self.fetch_misses
        misses.add_metric(["absent"], c.get("misses_absent", 0) + fetched.get("absent", 0))
        misses.add_metric(["corrupt"], c.get("misses_corrupt", 0) + c.get("misses_truncated", 0)
                          + fetched.get("corrupt", 0))
        misses.add_metric(["unreachable"], c.get("match_failures", 0))
        yield misses


def _by_label(name: str, doc: str, label: str, counts: dict[str, int], scale: float) -> Iterator:
    g = GaugeMetricFamily(name, doc, labels=[label])
    for value, n in sorted(counts.items()):
        g.add_metric([value], n * scale)
    yield g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c
