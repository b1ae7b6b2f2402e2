"""Driving a server with scaled requests, open loop, and measuring what calibrates the simulator.

Open loop: request i is sent at its scaled arrival time whatever the earlier ones are doing
(a thread each, at most `max_inflight` at once; a request that finds them all busy waits and its
late start is reported as `late_sends`). Calibration, before the trace, on prompts of unique random
tokens under their own cache salt (they never share a block with the trace): one warm-up, then
pairs of cold prefills of `CAL_SHORT` and `CAL_LONG` tokens, one at a time, with one generated
token; prefill tokens/s = (long − short) / (TTFT long − TTFT short), the median of the pairs (the
difference removes the per-request overhead: HTTP, CHECK, one decode step). Fetch: the growth of
the server's `kvledger_fetch_seconds_sum` during the run (`/metrics`), when it exposes it, set
against the block bytes of the cached tokens the responses report (see `Calibration`).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvledger.bench.replay_client import ReplayOutcome, completion_body, send
from kvledger.bench.replay_scale import ScaledRequest, block_tokens_of

CAL_SHORT, CAL_PAIRS = 128, 2
MEASURED = "block bytes of the cached tokens (responses) / growth of kvledger_fetch_seconds_sum (/metrics)"
UNMEASURED = "not measured (nothing fetched from the store, or the server has no kvledger_fetch_seconds)"


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured on the live server. Units: tokens/s, bytes, seconds; None when not measurable.

    `fetch_s` is the growth of the server's `kvledger_fetch_seconds_sum` over the run: the seconds
    its engines spent getting hit blocks in (device prefix cache or store). `hit_bytes` are the
    block bytes of every cached token, `store_bytes` of those read from the store (`usage.kvledger`)."""

    prefill_tokens_per_s: float | None               # idle probes (see the module docstring)
    probe_tokens: tuple[int, int]                    # (short, long) probe prompt lengths
    prefill_pairs: tuple[tuple[float, float], ...]   # (TTFT short, TTFT long) per pair, seconds
    fetch_s: float | None = None
    hit_bytes: int = 0
    store_bytes: int = 0

    @property
    def read_bytes_per_s(self) -> float | None:
        """Hit bytes per fetch second: what the simulator, which charges every hit byte a fetch, needs."""
        return self.hit_bytes / self.fetch_s if self.fetch_s and self.hit_bytes else None

    @property
    def store_read_bytes_per_s(self) -> float | None:
        """Store bytes per fetch second: a lower bound on the store's read rate (the seconds include
        the device-cached blocks' hand-over and the fetcher's queueing under load)."""
        return self.store_bytes / self.fetch_s if self.fetch_s and self.store_bytes else None

    def to_json(self) -> dict:
        return {"prefill_tokens_per_s_idle": self.prefill_tokens_per_s, "prefill_probe_tokens": list(self.probe_tokens),
                "prefill_probe_ttft_s": [list(p) for p in self.prefill_pairs], "fetch_s": self.fetch_s,
                "hit_bytes": self.hit_bytes, "store_bytes": self.store_bytes,
                "read_bytes_per_s": self.read_bytes_per_s, "store_read_bytes_per_s": self.store_read_bytes_per_s,
                "read_bytes_per_s_source": MEASURED if self.read_bytes_per_s else UNMEASURED}


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send: the server's URL, its model name, the run's salt, the bearer key."""

    url: str
    model: str
    salt: str
    api_key: str | None = None
    timeout_s: float = 300.0

    def send(self, tokens: np.ndarray, max_tokens: int, index: int, salt: str | None = None,
             sent_at: float = 0.0) -> ReplayOutcome:
        body = completion_body(self.model, [int(t) for t in tokens], max_tokens, salt or self.salt)
        return send(self.url, body, index, api_key=self.api_key, timeout_s=self.timeout_s, sent_at=sent_at)


def calibrate_prefill(target: Target, long_tokens: int) -> tuple[float | None, tuple[tuple[float, float], ...]]:
    """Prefill tokens/s of one engine from cold probes (see the module docstring); none when
    `long_tokens` is 0."""
    salt = f"{target.salt}-calibration"
    target.send(block_tokens_of(-7, 16), 1, -1, salt)    # warm-up: the first request pays one-time costs
    pairs = []
    for i in range(CAL_PAIRS if long_tokens else 0):
        short = target.send(block_tokens_of(-(100 + 2 * i), CAL_SHORT), 1, -1, salt)
        long_ = target.send(block_tokens_of(-(101 + 2 * i), long_tokens), 1, -1, salt)
        if short.ok and long_.ok and long_.cached_tokens == 0:
            pairs.append((short.ttft_s, long_.ttft_s))
    rates = [(long_tokens - CAL_SHORT) / (b - a) for a, b in pairs if b > a]
    return (float(np.median(rates)) if rates else None), tuple(pairs)


def reachable(url: str, api_key: str | None = None) -> bool:
    """Whether `url`/health answers 200 within 10 s."""
    req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def fetch_seconds(url: str, api_key: str | None = None) -> float | None:
    """The server's `kvledger_fetch_seconds_sum` (seconds spent loading hit blocks from the store),
    or None when absent or unreachable."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "kvledger_fetch_seconds_sum":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def drive(target: Target, requests: Sequence[ScaledRequest], max_inflight: int,
          on_done: Callable[[ReplayOutcome], None] = lambda o: None) -> tuple[list[ReplayOutcome], float, int]:
    """Send every request at its arrival time; (outcomes in request order, wall seconds, late sends).
    A send counts as late when it starts more than 0.5 s after its arrival time."""
    outcomes: list[ReplayOutcome | None] = [None] * len(requests)
    late = 0
    lock = threading.Lock()
    start = time.perf_counter()

    def one(pos: int, r: ScaledRequest) -> None:
        nonlocal late
        sent_at = time.perf_counter() - start
        with lock:
            late += sent_at - r.arrival_s > 0.5
        outcomes[pos] = o = target.send(r.tokens, r.max_tokens, r.index, sent_at=sent_at)
        on_done(o)

    pool = ThreadPoolExecutor(max_inflight, thread_name_prefix="replay")
    try:
        for pos, r in enumerate(requests):
            delay = start + r.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, pos, r)
    except BaseException:   # Ctrl-C: drop what is not sent yet; the caller stops the server
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    assert all(o is not None for o in outcomes), "a request thread died without an outcome"
    return [o for o in outcomes if o is not None], time.perf_counter() - start, late
