"""What the operator page shows beyond `/metrics`: the last requests and the hit rate over time.

Both live in memory only (a restart starts them empty); the cumulative figures of the page
come from `/metrics` itself, so the two never disagree.
"""

from __future__ import annotations

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


class Activity:
    """The last `keep` requests, and per `bucket_s` seconds the prompt and cached tokens."""

    def __init__(self, keep: int = 50, bucket_s: float = 5.0, buckets: int = 720) -> None:
        assert keep > 0 and bucket_s > 0 and buckets > 0
        self.recent: deque[RequestRecord] = deque(maxlen=keep)
        self.series: deque[Bucket] = deque(maxlen=buckets)
        self.bucket_s = bucket_s
        self.started = time.time()
        self.totals = Totals()

    def record(self, rec: RequestRecord) -> None:
        self.recent.append(rec)
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
                "series": [asdict(b) for b in self.series]}
