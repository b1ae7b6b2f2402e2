"""The load of `kvledger bench chaos`, and its check against a single-process reference.

Clients run bounded multi-turn conversations, greedy: each starts from one of a few shared system prompts
(so conversations of every client share prefixes), adds a user turn of random tokens, sends it, appends the
reply, up to TURNS turns; a failed turn ends its conversation. Every request is kept as a `Sample`: the
prompt, the reply, the usage (with the engine legs it ran as), the HTTP status, the time, and the fault in
effect when it was sent.

The check. A reply is right when it equals what one no-cache engine (`kvledger serve --no-cache`) computes
for the same prompt and max_tokens in one request, whatever legs, engines and hits the cluster used (DESIGN
rule 10: the answer does not depend on the topology, and the reference is never split the way the system
under test is). tiny-v4 claims bit-exactness, so any other reply is a wrong answer. A usage that claims more
cached tokens than the prompt minus what the engine ran through the model is an over-claim.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvledger.util.serve_process import request

MODEL = "tiny-v4"
VOCAB = 32000
SYSTEM_LENGTHS = (300, 520, 700)   # the shared system prompts: every conversation starts with one
TURNS = 4                          # turns of one conversation, then a new one
USER_TOKENS = (10, 150)            # a user turn's length, uniform
REPLY_TOKENS = (4, 16)             # a reply's max_tokens, uniform (ignore_eos: every reply has that many)
CLIENT_TIMEOUT_S = 120.0
HUNG_S = 60.0                      # a request that took longer hung, whatever it answered


@dataclass(slots=True)
class Sample:
    """One request of the load. Times are seconds since the run's start."""

    client: int
    prompt: list[int]
    max_tokens: int
    sent: float
    fault: str                     # the fault in effect when it was sent ("" for none)
    elapsed: float = 0.0
    status: int = 0                # HTTP status; 0: no answer (refused, reset, timed out)
    error: str | None = None
    output: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200

    @property
    def cached(self) -> int:
        return int((self.usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0))

    def overclaimed(self) -> bool:
        """The usage says more prompt tokens were reused than the engine did not compute."""
        computed = ((self.usage or {}).get("kvledger") or {}).get("computed_prompt_tokens")
        return computed is not None and self.cached > len(self.prompt) - int(computed)


def complete(url: str, tokens: list[int], max_tokens: int, timeout_s: float = CLIENT_TIMEOUT_S
             ) -> tuple[int, dict[str, Any], str | None]:
    """(status, body, error) of one greedy /v1/completions call; status 0 when no answer came."""
    body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        status, raw = request(url + "/v1/completions", json.dumps(body).encode(),
                              {"Content-Type": "application/json"}, timeout=timeout_s)
    except (OSError, urllib.error.URLError) as e:   # refused, reset, timed out
        return 0, {}, f"{type(e).__name__}: {e}"[:200]
    try:
        out = json.loads(raw)
    except ValueError:
        return status, {}, f"not JSON: {raw[:100]!r}"
    return status, out, None if status == 200 else str(out.get("error", {}).get("message", ""))[:200]


class Load:
    """`clients` threads sending conversations to `url` until `stop()`; `samples` grows as they answer."""

    def __init__(self, url: str, clients: int, seed: int, fault: Callable[[], str]) -> None:
        self.url, self.fault = url, fault
        rng = random.Random(seed)
        self.systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in SYSTEM_LENGTHS]
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i, seed * 1000 + i), daemon=True)
                         for i in range(clients)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """No new request; wait for those in flight (each is bounded by CLIENT_TIMEOUT_S)."""
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT_S + 10)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _client(self, client: int, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            tokens = list(rng.choice(self.systems))
            for _ in range(TURNS):
                if self._stop.is_set():
                    return
                tokens += [rng.randrange(3, VOCAB) for _ in range(rng.randint(*USER_TOKENS))]
                sample = Sample(client, list(tokens), rng.randint(*REPLY_TOKENS), self.now(), self.fault())
                status, body, error = complete(self.url, tokens, sample.max_tokens)
                sample.elapsed, sample.status, sample.error = self.now() - sample.sent, status, error
                if status == 200:
                    sample.output = [int(t) for t in body["choices"][0]["token_ids"]]
                    sample.usage = body.get("usage")
                with self._lock:
                    self.samples.append(sample)
                if not sample.completed:
                    time.sleep(0.2)   # a failed turn ends the conversation
                    break
                tokens += sample.output


def reference_of(url: str, sample: Sample) -> list[int] | None:
    """The reply the no-cache server at `url` computes for the sample's prompt, in one request (never split
    along the legs the sample took: rule 10); None when it did not answer."""
    status, body, _ = complete(url, sample.prompt, sample.max_tokens)
    if status != 200:
        return None
    return [int(t) for t in body["choices"][0]["token_ids"]]


@dataclass(slots=True)
class Checked:
    wrong: list[dict[str, Any]]      # each wrong answer: where, what it got, what the reference says
    unchecked: int                   # completed replies the reference did not answer for


def check_against(urls: list[str], samples: list[Sample], workers_per_url: int = 2) -> Checked:
    """Every completed sample against the reference servers at `urls` (sample i on urls[i % len(urls)];
    `workers_per_url` requests at once on each, so each computes while the next request arrives)."""
    done = [s for s in samples if s.completed]
    with ThreadPoolExecutor(workers_per_url * len(urls)) as pool:
        refs = list(pool.map(lambda i: reference_of(urls[i % len(urls)], done[i]), range(len(done))))
    wrong = [{"client": s.client, "sent_s": round(s.sent, 2), "fault": s.fault, "prompt_tokens": len(s.prompt),
              "legs": ((s.usage or {}).get("kvledger") or {}).get("legs"), "got": s.output, "reference": ref}
             for s, ref in zip(done, refs) if ref is not None and ref != s.output]
    return Checked(wrong, sum(1 for r in refs if r is None))
