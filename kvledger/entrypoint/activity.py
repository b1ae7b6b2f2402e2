"""What the operator page shows beyond `/metrics`: the last requests, the hit rate over time, and
TTFT p50 per prompt length, cold and hit.

All live in memory only (a restart starts them empty); the cumulative figures of the page
come from `/metrics` itself, so the two never disagree.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request as the page lists it (no prompt text: the page shows metadata only)."""

    at: float                 # epoch seconds at the end
    request_id: str
    namespace: str
    endpoint: str             # "chat" | "completion"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_kind: str
    ttft_s: float | None
    finish_reason: str | None


@dataclass(slots=True)
class Bucket:
    start: float              # epoch seconds, a multiple of the bucket width
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, rec: RequestRecord) -> None:
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.cached_tokens += rec.cached_tokens


@dataclass(frozen=True, slots=True)
class Totals:
    """Counts since the start; two of them make a status line."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def status_line(now: Totals, before: Totals, seconds: float, running: int) -> str | None:
    """What the server did in the last `seconds` (None when it did nothing), as vLLM's periodic log line:
    throughputs, requests running, and the prefix cache hit rate of the interval and since the start."""
    assert seconds > 0
    done, prompt = now.requests - before.requests, now.prompt_tokens - before.prompt_tokens
    if done == 0 and running == 0:
        return None
    cached, generated = now.cached_tokens - before.cached_tokens, now.completion_tokens - before.completion_tokens
    interval = f"{100 * cached / prompt:.1f}%" if prompt else "-"
    overall = f"{100 * now.cached_tokens / now.prompt_tokens:.1f}%" if now.prompt_tokens else "-"
    return (f"last {seconds:.0f} s: {done} requests done, {running} running; prompt {prompt / seconds:,.1f} "
            f"tokens/s, generation {generated / seconds:,.1f} tokens/s; prefix cache hit rate {interval} "
            f"({cached:,} of {prompt:,} prompt tokens), {overall} since the start")


def length_bucket(prompt_tokens: int) -> int:
    """The power of two at or above `prompt_tokens`: requests of (b/2, b] tokens share bucket b
    (1 → 1, 128 → 128, 129 → 256, 2,000 → 2,048)."""
    return 1 << max(prompt_tokens - 1, 0).bit_length()


class TtftByLength:
    """TTFT of the last `window` requests per (prompt-length bucket, cold | hit): a mean over all
    lengths mixes a 100-token prompt with a 4,000-token one, so cold and hit compare per bucket.
    "hit" means some prompt tokens came from the cache, as `kvledger_time_to_first_token_seconds`."""

    def __init__(self, window: int = 256) -> None:
        assert window > 0
        self.window = window
        self.samples: dict[tuple[int, str], deque[float]] = {}

    def record(self, prompt_tokens: int, cached_tokens: int, ttft_s: float | None) -> None:
        if ttft_s is None:
            return
        cell = (length_bucket(prompt_tokens), "hit" if cached_tokens > 0 else "cold")
        self.samples.setdefault(cell, deque(maxlen=self.window)).append(ttft_s)

    def as_json(self) -> dict:
        """{"window", "buckets": [{"tokens_from", "tokens_to", "cold": {"requests", "p50_s"}, "hit": ...}]},
        ascending; p50_s is None where a bucket has no request of that kind."""
        rows = []
        for b in sorted({b for b, _ in self.samples}):
            row: dict = {"tokens_from": b // 2 + 1, "tokens_to": b}
            for cache in ("cold", "hit"):
                xs = self.samples.get((b, cache), ())
                row[cache] = {"requests": len(xs), "p50_s": statistics.median(xs) if xs else None}
            rows.append(row)
        return {"window": self.window, "buckets": rows}


class Activity:
    """The last `keep` requests, per `bucket_s` seconds the prompt and cached tokens, and TTFT by
    prompt length (`TtftByLength`)."""

    def __init__(self, keep: int = 50, bucket_s: float = 5.0, buckets: int = 720) -> None:
        assert keep > 0 and bucket_s > 0 and buckets > 0
        self.recent: deque[RequestRecord] = deque(maxlen=keep)
        self.series: deque[Bucket] = deque(maxlen=buckets)
        self.ttft = TtftByLength()
        self.bucket_s = bucket_s
        self.started = time.time()
        self.totals = Totals()

    def record(self, rec: RequestRecord) -> None:
        self.recent.append(rec)
        self.ttft.record(rec.prompt_tokens, rec.cached_tokens, rec.ttft_s)
        start = rec.at - rec.at % self.bucket_s
        if not self.series or self.series[-1].start < start:
            self.series.append(Bucket(start))
        self.series[-1].add(rec)
        t = self.totals
        self.totals = Totals(t.requests + 1, t.prompt_tokens + rec.prompt_tokens, t.cached_tokens + rec.cached_tokens,
                             t.completion_tokens + rec.completion_tokens)

    def as_json(self) -> dict:
        return {"started": self.started, "bucket_s": self.bucket_s,
                "recent": [asdict(r) for r in reversed(self.recent)],
                "series": [asdict(b) for b in self.series], "ttft_by_length": self.ttft.as_json()}
