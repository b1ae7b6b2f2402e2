"""Routing (DESIGN.md rule 5): which engine computes a prompt, which one decodes it. No I/O here.

The entrypoint has already decided the hit from metadata (the CHECK), so every engine can serve
every prefix; a policy only weighs the engines' queues and, optionally, where a prefix went before.

| policy            | prefill engine                                                    | note                      |
|-------------------|-------------------------------------------------------------------|---------------------------|
| `cache-aware`     | least cost = prompt tokens left to compute + prefill tokens       | ties → the engine that    |
|                   | queued there (queued = max(this entrypoint's own count, the       | last served the prefix    |
|                   | engine's last heartbeat))                                         | (device cache may hold it)|
| `round-robin`     | the next one in turn                                              | ignores load and prefixes |
| `least-loaded`    | fewest requests running                                           | ignores prefixes          |
| `prefix-affinity` | a fixed engine per prefix (rendezvous hash of the first block key)| the local-cache design    |

Decode engines (P/D mode) are picked by decode load: fewest requests running, ties by id.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.engine.defaults import DEFAULTS
from kvledger.engine.engine_registry import EngineInfo

POLICIES = ("cache-aware", "round-robin", "least-loaded", "prefix-affinity")
AFFINITY_MEMORY = 65_536   # prefixes whose last engine cache-aware remembers


@dataclass(frozen=True, slots=True)
class PromptView:
    """What routing may know of a prompt: metadata only."""

    tokens: int              # prompt length
    to_compute: int          # tokens the engine computes (prompt − hit)
    prefix_key: bytes        # the first block's chain key (or a hash of a prompt shorter than a block)


@dataclass(slots=True)
class Load:
    """This entrypoint's own view of one engine: what it sent there and has not seen finish."""

    queued_prefill_tokens: int = 0
    running: int = 0


class Router:
    def __init__(self, policy: str = DEFAULTS.routing) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.turn = 0
        self.last_engine: OrderedDict[bytes, str] = OrderedDict()

    def pick_prefill(self, prompt: PromptView, engines: Sequence[EngineInfo], loads: dict[str, Load]) -> EngineInfo:
        assert engines, "the caller checks that a prefill engine exists"
        engines = sorted(engines, key=lambda e: e.engine_id)
        if self.policy == "round-robin":
            chosen = engines[self.turn % len(engines)]
            self.turn += 1
        elif self.policy == "least-loaded":
            chosen = min(engines, key=lambda e: (_running(e, loads), e.engine_id))
        elif self.policy == "prefix-affinity":
            chosen = max(engines, key=lambda e: hashlib.blake2b(prompt.prefix_key + e.engine_id.encode(),
                                                                digest_size=8).digest())
        else:
            chosen = self._cache_aware(prompt, engines, loads)
        self._remember(prompt.prefix_key, chosen.engine_id)
        return chosen

    def pick_decode(self, engines: Sequence[EngineInfo], loads: dict[str, Load]) -> EngineInfo:
        assert engines, "the caller checks that a decode engine exists"
        return min(engines, key=lambda e: (_running(e, loads), e.engine_id))

    def _cache_aware(self, prompt: PromptView, engines: Sequence[EngineInfo], loads: dict[str, Load]) -> EngineInfo:
        last = self.last_engine.get(prompt.prefix_key)

        def cost(e: EngineInfo) -> tuple[int, int, str]:
            load = loads.get(e.engine_id, Load())
            queued = max(load.queued_prefill_tokens, e.queued_prefill_tokens)
            return prompt.to_compute + queued, 0 if e.engine_id == last else 1, e.engine_id

        return min(engines, key=cost)

    def _remember(self, prefix_key: bytes, engine_id: str) -> None:
        self.last_engine[prefix_key] = engine_id
        self.last_engine.move_to_end(prefix_key)
        while len(self.last_engine) > AFFINITY_MEMORY:
            self.last_engine.popitem(last=False)


def _running(e: EngineInfo, loads: dict[str, Load]) -> int:
    return max(loads.get(e.engine_id, Load()).running, e.running)
