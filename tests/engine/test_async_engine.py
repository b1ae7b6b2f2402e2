"""A request that fails inside a step ends alone: the batch's other requests finish with all their tokens
(it once failed every running request: `AsyncEngine._fail_all` after a `torch.multinomial` error)."""

import asyncio

import pytest

from kvledger.core import chain_keys, decide_hit
from kvledger.engine import engine as engine_module
from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.engine.async_engine import AsyncEngine
from kvledger.engine.client import EngineFailed
from tests.engine.helpers import prompt, run_python

POISON_SEED = 666     # the request whose sampling fails (the patched sampler recognises it by its seed)
FAILS_AT = 3          # ... at its third output token, while the normal one decodes in the same batch
NORMAL_TOKENS = 24


PROMPT = [t % 32000 for t in prompt(40, seed=5)]


@pytest.fixture(autouse=True)
def poisoned_sampler(monkeypatch):
    real = engine_module.sample_one

    def sample(logits, params, seen, generator):
        if params.seed == POISON_SEED and len(seen) >= len(PROMPT) + FAILS_AT - 1:
            raise RuntimeError("poisoned draw")
        return real(logits, params, seen, generator)

    monkeypatch.setattr(engine_module, "sample_one", sample)


def _engine() -> engine_module.Engine:
    return engine_module.Engine("tiny-v4", block_ledger=None, kv_cache_bytes=16 << 20)


def _request(engine, rid: str, seed: int | None) -> EngineRequest:
    keys = chain_keys(PROMPT, engine.spec, "default")
    decision = decide_hit(len(PROMPT), 0, set(), engine.spec)
    sampling = SamplingParams(max_tokens=NORMAL_TOKENS, temperature=0.8, seed=seed, ignore_eos=True)
    return EngineRequest(rid, PROMPT, keys, decision, sampling)


def test_the_engine_ends_only_the_failed_sequence():
    tiny = _engine()
    try:
        tiny.add_request(_request(tiny, "normal", 1))
        tiny.add_request(_request(tiny, "poisoned", POISON_SEED))
        tokens, reasons = {"normal": [], "poisoned": []}, {}
        while tiny.has_unfinished():
            for ev in tiny.step():
                tokens[ev.request_id] += ev.token_ids
                if ev.finished:
                    reasons[ev.request_id] = ev.finish_reason
        assert reasons == {"normal": "length", "poisoned": "error"}
        assert len(tokens["normal"]) == NORMAL_TOKENS and len(tokens["poisoned"]) == FAILS_AT - 1
        tiny.check_integrity()   # the failed sequence's blocks and slot went back
    finally:
        tiny.close()


def test_the_async_engine_fails_that_request_alone():
    async def collect(engine: AsyncEngine, req: EngineRequest) -> list[int]:
        return [t async for ev in engine.generate(req) for t in ev.token_ids]

    async def main() -> list:
        tiny = _engine()
        engine = AsyncEngine(tiny)
        engine.start(asyncio.get_running_loop())
        try:
            return await asyncio.gather(collect(engine, _request(tiny, "normal", 1)),
                                        collect(engine, _request(tiny, "poisoned", POISON_SEED)),
                                        return_exceptions=True)
        finally:
            await asyncio.to_thread(engine.close)

    normal, poisoned = asyncio.run(main())
    assert isinstance(poisoned, EngineFailed)
    assert isinstance(normal, list) and len(normal) == NORMAL_TOKENS, normal


def test_start_releases_the_loading_threads_openmp_team():
    """Only the loop thread computes once started: the loading thread's idle team would make GNU OpenMP throttle
    every worker's spinning (threads.py), so `start` lets it go."""
    run_python("""
        import asyncio, os, torch
        from kvledger.core import chain_keys, decide_hit
        from kvledger.engine.api import EngineRequest, SamplingParams
        from kvledger.engine.async_engine import AsyncEngine
        from kvledger.engine.engine import Engine
        from kvledger.engine.threads import release_team
        tids = lambda: set(os.listdir("/proc/self/task"))
        torch.set_num_threads(2)
        tiny = Engine("tiny-v4", block_ledger=None, kv_cache_bytes=16 << 20)
        a = torch.randn(1024, 1024)
        release_team()                                      # the load's team, to tell its workers from the rest
        before = tids(); a @ a; workers = tids() - before   # this thread's team again, as a load leaves it
        assert workers

        async def main():
            engine = AsyncEngine(tiny)
            engine.start(asyncio.get_running_loop())
            prompt = list(range(100, 140))
            req = EngineRequest("r", prompt, chain_keys(prompt, tiny.spec, "default"),
                                decide_hit(len(prompt), 0, set(), tiny.spec), SamplingParams(max_tokens=4))
            tokens = [t async for ev in engine.generate(req) for t in ev.token_ids]
            left = workers & tids()
            await asyncio.to_thread(engine.close)
            return tokens, left

        tokens, left = asyncio.run(main())
        assert len(tokens) == 4 and not left, (tokens, left)
    """)
