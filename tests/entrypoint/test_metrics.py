"""`/metrics` never scans the store itself: a million blocks took 3.76 s a scan, and concurrent scrapes
each ran one (RSS and latency blew up). The figures come from one background scan at a time."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import generate_latest

from kvledger.entrypoint.metrics import STATS_WAIT_S, ServeMetrics
from kvledger.store.backend import StoreStats

SCRAPES = 32


class SlowScan:
    """A store scan that counts its calls and runs until `release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def __call__(self) -> StoreStats:
        self.calls += 1
        self.release.wait(5)
        return StoreStats("file", "/x", blocks=7, live_bytes=700, per_class={"chatbot": 7},
                          per_namespace={"alpha": 7})


def _scrape(metrics: ServeMetrics) -> tuple[float, str]:
    started = time.monotonic()
    text = generate_latest(metrics.registry).decode()
    return time.monotonic() - started, text


def test_concurrent_scrapes_cost_one_scan():
    scan = SlowScan()
    metrics = ServeMetrics(scan)
    with ThreadPoolExecutor(SCRAPES) as pool:
        futures = [pool.submit(_scrape, metrics) for _ in range(SCRAPES)]
        time.sleep(0.5)
        scan.release.set()
        for f in futures:
            f.result(timeout=60)
    assert scan.calls == 1, f"{scan.calls} store scans for {SCRAPES} concurrent scrapes"
    deadline = time.monotonic() + 10
    while "kvledger_store_blocks{" not in (text := _scrape(metrics)[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 'kvledger_store_blocks{ttl_class="chatbot"} 7.0' in text   # the scan's figures, once it ends
    assert scan.calls == 1   # fresh figures: no second scan


def test_a_scrape_never_waits_long_on_a_scan_in_progress():
    scan = SlowScan()
    metrics = ServeMetrics(scan)
    try:
        first, _ = _scrape(metrics)     # starts the scan, waits STATS_WAIT_S at most
        second, _ = _scrape(metrics)    # the scan still runs: the last figures at once
        assert first < STATS_WAIT_S + 1.0 and second < 0.5, (first, second)
    finally:
        scan.release.set()


def test_counters_are_live_between_scans():
    stats = StoreStats("file", "/x", blocks=1, live_bytes=1, counters={"misses_corrupt": 0})
    live = {"misses_corrupt": 0}
    metrics = ServeMetrics(lambda: stats, lambda: dict(live))
    assert 'kvledger_store_read_misses_total{cause="corrupt"} 0.0' in _scrape(metrics)[1]
    live["misses_corrupt"] = 3
    assert 'kvledger_store_read_misses_total{cause="corrupt"} 3.0' in _scrape(metrics)[1]


def test_an_engine_back_with_another_pid_counts_as_a_restart():
    from kvledger.engine.engine_registry import EngineInfo

    from .metrics_text import metric

    def engine(engine_id: str, role: str, pid: int) -> EngineInfo:
        return EngineInfo(engine_id, role, "http://127.0.0.1:1", "tiny-v4", 4096, 32000, (2,), pid)

    metrics = ServeMetrics(lambda: None)
    metrics.engines_listed([engine("prefill-0", "prefill", 10), engine("decode-0", "decode", 11)])
    metrics.engines_listed([engine("prefill-0", "prefill", 10)])                  # decode-0 died: gone
    metrics.engines_listed([engine("prefill-0", "prefill", 10), engine("decode-0", "decode", 12)])   # back
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "kvledger_engine_restarts_total", engine="decode-0") == 1
    assert metric(text, "kvledger_engine_restarts_total", engine="prefill-0") == 0
    assert metric(text, "kvledger_engines", role="decode") == 1 and metric(text, "kvledger_engines") == 2


def test_preemptions_are_a_counter_named_as_prometheus_asks():
    from .metrics_text import metric

    metrics = ServeMetrics(lambda: None)
    metrics.preemptions.inc(2)
    assert metric(generate_latest(metrics.registry).decode(), "kvledger_engine_preemptions_total") == 2
