"""Prompt tails kept for a P/D hand-off, by `core.tail_key`: the KV of a prefilled prompt's partial last block
and, for a windowed model, its windows at the prompt's end (`core.tail_parts`).

A prefill leg asked to keep its tail (`EngineRequest.keep_tail`) leaves it here; the decode engine pulls it
(`GET /engine/v1/tail/{key}`, engine/process.py) and computes only the last token instead of the whole tail
(Gemma 3: up to 128 tokens through every layer, or 129 after a prompt of whole blocks). A tail is taken once or
outlives `ttl_s`, whichever comes first, and the store holds at most `capacity_bytes` (the oldest go first): a
tail nobody pulls costs the decode leg a recompute, never a wrong answer.

Thread-safe: the engine's step thread puts, the HTTP server's loop takes. Each tail names its tenant, so a
forget of the tenant (DESIGN rule 12) drops its tails at once (`forget`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

DEFAULT_TTL_S = 30.0
DEFAULT_CAPACITY_BYTES = 128 << 20   # SmolLM2: 45 tails of 2.8 MiB; Gemma 3: 15 of up to 8 MiB


class TailStore:
    """Invariants: `held_bytes` is the sum of the held tails' lengths and stays <= `capacity_bytes`; the dict is
    in insertion order, so the first entry is the oldest."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        assert ttl_s > 0 and capacity_bytes > 0
        self.ttl_s, self.capacity_bytes = ttl_s, capacity_bytes
        self._tails: OrderedDict[bytes, tuple[float, bytearray, str]] = OrderedDict()   # key → (deadline, KV, tenant)
        self.held_bytes = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, kv: bytearray, tenant: str = "") -> None:
        """Keep `kv` under `key` for `ttl_s` seconds (a tail larger than the whole store is not kept)."""
        if len(kv) > self.capacity_bytes:
            return
        with self._lock:
            self._drop(key)
            self._tails[key] = (time.monotonic() + self.ttl_s, kv, tenant)
            self.held_bytes += len(kv)
            while self.held_bytes > self.capacity_bytes:
                self._drop(next(iter(self._tails)))

    def take(self, key: bytes) -> bytearray | None:
        """The tail under `key`, removed; None when absent or expired."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._tails.get(key)
            if entry is None:
                return None
            self._drop(key)
            return entry[1]

    def forget(self, tenant: str) -> int:
        """Drop every tail of `tenant`; how many."""
        with self._lock:
            mine = [k for k, (_, _, owner) in self._tails.items() if owner == tenant]
            for k in mine:
                self._drop(k)
        return len(mine)

    def __len__(self) -> int:
        return len(self._tails)

    def _expire(self, now: float) -> None:
        while self._tails and next(iter(self._tails.values()))[0] <= now:
            self._drop(next(iter(self._tails)))

    def _drop(self, key: bytes) -> None:
        entry = self._tails.pop(key, None)
        if entry is not None:
            self.held_bytes -= len(entry[1])
