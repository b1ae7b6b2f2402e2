"""The state of one `kvledger serve` process: its configuration, ledgers, tokenizer, engine and gauges.

Embedded mode (DESIGN.md "Layout"): one process holds the block ledger (segment files under
`<data_dir>/blocks`, an in-process index), the state ledger's in-memory directory (models with
sliding-window layers), the tokenizer and one engine whose step loop runs in its own thread.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.entrypoint.activity import Activity
from kvledger.engine.async_engine import AsyncEngine
from kvledger.entrypoint.remote import RemoteEngines
from kvledger.entrypoint.auth import Tenant, load_keys
from kvledger.entrypoint.body_limit import BODY_TIMEOUT_S
from kvledger.entrypoint.cli import MAX_TOKENS_LIMIT, OPEN_PER_KEY, default_data_dir
from kvledger.entrypoint.metrics import ServeMetrics
from kvledger.engine.models import registry
from kvledger.engine.models.tokenizer import longest_token_bytes
from kvledger.store.ledger import BlockLedger, blocks_dir
from kvledger.store.ttl import TtlPolicy

MIB = 1 << 20
INTERRUPT_GRACE_S = 1.0   # Ctrl-C: an engine step still running after this long is left to the exit


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `kvledger serve` was started with. Limits are per request unless named otherwise."""

    model: str = registry.DEFAULT_MODEL   # a registry name or a path (`registry.resolve`)
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(default_factory=default_data_dir)
    api_keys: Path | None = None
    no_cache: bool = False             # every request computes its whole prompt (bench baseline)
    max_body_bytes: int = 4 * MIB
    body_timeout_s: float = BODY_TIMEOUT_S   # the whole body in within this long of the headers, else 408
    max_concurrent_per_key: int = OPEN_PER_KEY   # running + waiting requests of one key; more → 429
    default_max_tokens: int = 256      # chat requests that name no limit
    max_prompt_tokens: int | None = None   # None: the model's context minus one
    max_tokens_limit: int | None = MAX_TOKENS_LIMIT   # None: what the context leaves after the prompt
    max_num_seqs: int = 8
    status_every_s: float = 10.0           # a status line per this many seconds of activity; 0: none
    device: str = "cpu"
    replay: bool = False
    # cluster mode (`kvledger entrypoint`): no engine here; Redis holds the index, the directory and
    # the engine registry, and the engines are reached with the cluster token
    redis_url: str | None = None
    cluster_token: str | None = field(default=None, repr=False)
    routing: str = "cache-aware"

    def __post_init__(self) -> None:
        registry.resolve(self.model)   # ModelError (a ValueError) names what is served
        assert (self.redis_url is None) == (self.cluster_token is None), "the cluster mode needs both"
        assert self.max_body_bytes > 0 and self.max_concurrent_per_key > 0 and self.default_max_tokens > 0
        assert self.body_timeout_s > 0


class ServerState:
    """Everything the routes share. Built in the event loop's thread; `engine` is the only part
    another thread touches (its own loop thread)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.entry = registry.resolve(config.model)
        self.model = self.entry.name   # served under: /v1/models, the `model` field
        self.created = int(time.time())
        self.spec = self.entry.spec
        self.policy = TtlPolicy()
        self.keys: dict[str, Tenant] | None = (load_keys(config.api_keys, set(self.policy.classes))
                                               if config.api_keys is not None else None)
        self.block_ledger = BlockLedger.open(path=blocks_dir(config.data_dir), redis_url=config.redis_url,
                                             policy=self.policy)
        self.state_ledger = self._open_state_ledger()
        self.tokenizer, self.chat_template = self.entry.text()
        self.max_token_bytes = longest_token_bytes(self.tokenizer) if self.tokenizer is not None else 0
        self.metrics = ServeMetrics(self.store_stats, lambda: self.block_ledger.store.counters.as_dict())
        self.activity = Activity()
        self.in_flight: dict[str, int] = {}   # tenant label → requests admitted and not finished
        self.engine: AsyncEngine | RemoteEngines | None = None
        self._engine_core: Any = None          # the loaded embedded engine, before its loop starts
        self.stopping: Any = None              # asyncio.Event: set → requests in flight end with a 503
        self.loop: Any = None                  # the event loop serving the routes, once started
        self.interrupted = False
        self._closed = False
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_ids: tuple[int, ...] = ()

    def _open_state_ledger(self) -> Any:
        if not self.spec.has_swa:
            return None
        from kvledger.state.ledger import StateLedger

        if self.config.redis_url is None:   # snapshots also on disk beside the blocks: a restart keeps exact hits
            return StateLedger(self.spec, token=secrets.token_hex(16), strategy="full",
                               root=blocks_dir(self.config.data_dir), serve=False, heartbeat=False).start()
        from kvledger.state.redis_directory import RedisDirectory

        # the entrypoint holds no snapshot: it only looks positions up (CHECK)
        return StateLedger(self.spec, token=self.config.cluster_token, directory=RedisDirectory(self.config.redis_url),
                           capacity_bytes=0, serve=False, heartbeat=False).start()

    def load_engine(self) -> None:
        """Embedded: load the model (seconds; the first run converts its weights, tens of seconds).
        Runs in the caller's thread, before the event loop starts, so Ctrl-C stops a load at once.
        Cluster: nothing to load (the entrypoint holds no weights)."""
        if self.config.redis_url is not None or self._engine_core is not None:
            return
        from kvledger.engine.engine import Engine

        cache = not self.config.no_cache   # the baseline neither reads nor writes the ledgers
        engine = Engine(self.entry, block_ledger=self.block_ledger if cache else None,
                        state_ledger=self.state_ledger if cache else None,
                        device=self.config.device, max_num_seqs=self.config.max_num_seqs,
                        replay=self.config.replay)
        self._engine_core = engine
        self.max_model_len = engine.max_model_len
        self.eos_token_ids = tuple(engine.eos_token_ids)
        self.vocab_size = _vocab_size(engine, self.tokenizer)

    def start_engine(self) -> AsyncEngine | RemoteEngines:
        """Embedded: start the loaded engine's step loop (loading it first if `load_engine` was not
        called). Cluster: start following the engine registry. Call from the event loop's thread."""
        import asyncio

        self.loop = loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        if self.config.redis_url is not None:
            return self._start_remote(loop)
        self.load_engine()
        assert self._engine_core is not None
        self.engine = AsyncEngine(self._engine_core)
        self.engine.start(loop)
        return self.engine

    def stop_requests(self) -> None:
        """End every request in flight now with a 503 (the end of a drain); thread-safe."""
        if self.stopping is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)

    def interrupt(self) -> None:
        """Ctrl-C: end every request in flight now, and close without waiting for a step (`close`)."""
        self.interrupted = True
        self.stop_requests()

    def _start_remote(self, loop: Any) -> RemoteEngines:
        from kvledger.engine.registry import Registry
        from kvledger.entrypoint.check import check_prompt
        from kvledger.entrypoint.router import Router
        from kvledger.state.auth import derive_keys

        def check(tokens: Any, namespace: str, ttl_class: str | None) -> Any:
            return check_prompt(tokens, self.spec, block_ledger=self.block_ledger, state_ledger=self.state_ledger,
                                namespace=namespace, ttl_class=ttl_class, replay=self.config.replay)

        assert self.config.redis_url is not None and self.config.cluster_token is not None
        registry = Registry.from_url(self.config.redis_url, derive_keys(self.config.cluster_token).registry)
        self.engine = RemoteEngines(registry, Router(self.config.routing),
                                    self.config.cluster_token, check, self.spec, on_engine=self._learn_model,
                                    on_leg=self.metrics.leg)
        self.engine.start(loop)
        return self.engine

    def _learn_model(self, info: Any) -> None:
        """The model's limits, from a registered engine (the entrypoint loads no weights)."""
        if info.model != self.model:
            return
        self.max_model_len = info.max_model_len
        self.eos_token_ids = tuple(info.eos_token_ids)
        self.vocab_size = info.vocab_size

    def store_stats(self) -> Any:
        try:
            return self.block_ledger.stats()
        except Exception:  # a scrape never fails on a store fault (rule 8)
            return None

    def close(self) -> None:
        """Stop the engine and close the ledgers; a second call does nothing. After `interrupt()`, an
        engine still inside a step after INTERRUPT_GRACE_S is left to die with the process (its threads
        are daemons; the stores are crash-safe), and the ledgers it may be using are not closed under it."""
        if self._closed:
            return
        self._closed = True
        if self.engine is not None:
            if not self.engine.close(INTERRUPT_GRACE_S if self.interrupted else None):
                return
        elif self._engine_core is not None:   # loaded, its loop never started
            self._engine_core.close()
        if self.state_ledger is not None:
            self.state_ledger.close()
        self.block_ledger.close()


def _vocab_size(engine: Any, tokenizer: Any) -> int:
    for owner in (engine, getattr(engine, "model", None), getattr(engine, "config", None)):
        n = getattr(owner, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    assert tokenizer is not None, "the engine names its vocabulary size, or a tokenizer does"
    return tokenizer.get_vocab_size()
