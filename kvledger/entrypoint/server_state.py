"""The state of one `kvledger serve` process: its configuration, ledgers, tokenizer, engine and gauges.

Embedded mode (DESIGN.md "Layout"): one process holds the block ledger (segment files under
`<data_dir>/blocks`, an in-process index), the state ledger's in-memory directory (models with
sliding-window layers), the tokenizer and one engine whose step loop runs in its own thread.
"""

from __future__ import annotations

import time
from typing import Any

from kvledger.core import PUBLIC_NAMESPACE
from kvledger.engine.async_engine import AsyncEngine
from kvledger.engine.client import EngineClient
from kvledger.engine.ledgers import Part, open_ledgers
from kvledger.engine.models import registry
from kvledger.engine.models.tokenizer import encode_ids, longest_token_bytes
from kvledger.entrypoint.activity import Activity
from kvledger.entrypoint.auth import OPEN_NAMESPACE, Tenant, load_keys, tenant_count, tenant_quotas
from kvledger.entrypoint.config import ServeConfig
from kvledger.entrypoint.forget import Forgetting
from kvledger.entrypoint.metrics import ServeMetrics, public_namespace
from kvledger.entrypoint.misses import MissBook
from kvledger.util.public_prefix import PublicPrefixes, load_public_prefixes
from kvledger.entrypoint.remote import RemoteEngines
from kvledger.entrypoint.store_upkeep import PeriodicGc
from kvledger.entrypoint.trace_recorder import open_recorder
from kvledger.store.quota import resolve_quotas
from kvledger.store.ttl import TtlPolicy

INTERRUPT_GRACE_S = 1.0   # Ctrl-C: an engine step still running after this long is left to the exit


class ServerState:
    """Everything the routes share. Built in the event loop's thread; `engine` is the only part
    another thread touches (its own loop thread)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.entry = registry.resolve(config.model)
        self.model = self.entry.name   # served under: /v1/models, the `model` field
        self.created = int(time.time())
        self.spec = self.entry.spec
        self.policy = TtlPolicy(classes=config.ttl_classes) if config.ttl_classes else TtlPolicy()
        self.keys: dict[str, Tenant] | None = (load_keys(config.api_keys, set(self.policy.classes))
                                               if config.api_keys is not None else None)
        self.quotas = resolve_quotas(config.store_capacity_bytes, config.quota_flags, tenant_quotas(self.keys))
        self.tokenizer, self.chat_template = self.entry.text()   # before the ledgers: a bad model opens nothing
        self.public = self._public_prefixes()   # rule 12: swapped whole when an operator publishes or withdraws
        self.ledgers = open_ledgers(self.spec, config.data_dir, config.part, redis_url=config.redis_url,
                                    token=config.cluster_token, policy=self.policy,
                                    capacity_bytes=config.store_capacity_bytes, quotas=self.quotas)
        self.block_ledger, self.state_ledger = self.ledgers.block, self.ledgers.state
        self.max_token_bytes = longest_token_bytes(self.tokenizer) if self.tokenizer is not None else 0
        known = {t.namespace for t in self.keys.values()} if self.keys is not None else {OPEN_NAMESPACE}
        known.add(PUBLIC_NAMESPACE)   # the operator's published prefixes: a public name
        self.metrics = ServeMetrics(self.store_stats, lambda: self.block_ledger.store.counters.as_dict(),
                                    public_namespace(known))
        self.activity = Activity()
        tok = self.tokenizer   # spans are shown as text where there is a tokenizer, as token ids otherwise
        self.misses = MissBook(self.spec.block_size, tenants=tenant_count(self.keys),   # why prompts miss (misses.py)
                               decode=None if tok is None else lambda ids: tok.decode(ids, skip_special_tokens=False))
        self.trace = open_recorder(self)   # the server's own trace (`kvledger whatif` reads it)
        self.forgetting = Forgetting()     # tenants being forgotten, and held after (forget.py)
        self.upkeep: PeriodicGc | None = None  # embedded: expired blocks removed while serving
        self.in_flight: dict[str, int] = {}   # tenant label → requests admitted and not finished
        self.engine: EngineClient | None = None
        self._engine_core: Any = None          # the loaded embedded engine, before its loop starts
        self.stopping: Any = None              # asyncio.Event: set → requests in flight end with a 503
        self.loop: Any = None                  # the event loop serving the routes, once started
        self.interrupted = False
        self._closed = False
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_ids: tuple[int, ...] = ()

    def _public_prefixes(self) -> PublicPrefixes:
        b = self.spec.block_size
        if self.config.public_prefix is None:
            return PublicPrefixes(b)
        tokenize = self.tokenize if self.tokenizer is not None else None
        return load_public_prefixes(self.config.public_prefix, tokenize, None, b)

    def tokenize(self, text: str) -> list[int]:
        """`text` as the start of a prompt (as /v1/completions tokenizes a prompt string)."""
        assert self.tokenizer is not None
        return encode_ids(self.tokenizer, text)

    def load_engine(self) -> None:
        """Embedded: load the model (seconds; the first run converts its weights, tens of seconds).
        Runs in the caller's thread, before the event loop starts, so Ctrl-C stops a load at once.
        Cluster: nothing to load (the entrypoint holds no weights)."""
        if not self.config.embedded or self._engine_core is not None:
            return
        from kvledger.engine.engine import Engine

        cache = not self.config.no_cache   # the baseline neither reads nor writes the ledgers
        engine = Engine(self.entry, block_ledger=self.block_ledger if cache else None,
                        state_ledger=self.state_ledger if cache else None,
                        device=self.config.device, max_num_seqs=self.config.max_num_seqs,
                        replay=self.config.replay, checkpoint_every=self.config.checkpoint_every,
                        stream_hits=self.config.stream_hits, **self.config.device_pool())
        self._engine_core = engine
        self.max_model_len = engine.max_model_len
        self.eos_token_ids = tuple(engine.eos_token_ids)
        self.vocab_size = _vocab_size(engine, self.tokenizer)

    @property
    def hits_mode(self) -> str:
        """Embedded, once loaded: whether the engine streams its hits (`Engine.hits_mode`)."""
        assert self._engine_core is not None, "load_engine first"
        return self._engine_core.hits_mode

    def start_engine(self) -> EngineClient:
        """Embedded: start the loaded engine's step loop (loading it first if `load_engine` was not
        called). Cluster: start following the engine registry. Call from the event loop's thread."""
        import asyncio

        self.loop = loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        if not self.config.embedded:
            return self._start_remote(loop)
        self.load_engine()
        assert self._engine_core is not None
        if self.config.gc_interval_s > 0:
            self.upkeep = PeriodicGc(self.block_ledger, self.config.gc_interval_s).start()
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
        from kvledger.engine.engine_registry import Registry
        from kvledger.entrypoint.check import check_prompt
        from kvledger.entrypoint.router import Router
        from kvledger.state.auth import derive_keys

        def check(tokens: Any, namespace: str, ttl_class: str | None, known_keys: list[bytes], prompt_len: int,
                  public_blocks: int) -> Any:
            return check_prompt(tokens, self.spec, block_ledger=self.block_ledger, state_ledger=self.state_ledger,
                                namespace=namespace, ttl_class=ttl_class, replay=self.config.replay,
                                known_keys=known_keys, prompt_len=prompt_len, public_blocks=public_blocks)

        assert self.config.part is Part.ENTRYPOINT and self.config.redis_url and self.config.cluster_token
        engines = Registry.from_url(self.config.redis_url, derive_keys(self.config.cluster_token).registry)
        self.engine = RemoteEngines(engines, Router(self.config.routing),
                                    self.config.cluster_token, check, self.spec, on_members=self._members,
                                    on_leg=self.metrics.leg, tail_handoff=self.config.tail_handoff)
        self.engine.start(loop)
        return self.engine

    def _members(self, members: list[Any]) -> None:
        """Each listing of the registry: the model's limits (from the first engine), the engine metrics."""
        self.metrics.engines_listed(members)
        if members:
            self._learn_model(members[0])

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
        self.trace.close()
        if self.upkeep is not None:
            self.upkeep.stop()
        if self.engine is not None:
            if not self.engine.close(INTERRUPT_GRACE_S if self.interrupted else None):
                return
        elif self._engine_core is not None:   # loaded, its loop never started
            self._engine_core.close()
        self.ledgers.close()


def _vocab_size(engine: Any, tokenizer: Any) -> int:
    for owner in (engine, getattr(engine, "model", None), getattr(engine, "config", None)):
        n = getattr(owner, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    assert tokenizer is not None, "the engine names its vocabulary size, or a tokenizer does"
    return tokenizer.get_vocab_size()
