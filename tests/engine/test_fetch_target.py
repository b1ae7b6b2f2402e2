"""Where the fetcher reads a hit (fetch_target.py): on the CPU straight into the sequence's own device blocks, and
those blocks are reused by nobody while the fetcher may still write them (a request aborted while it loads)."""

import os
import signal
import time

import pytest

from kvledger.core import ModelSpec
from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.engine.fetch_target import PoolTarget
from kvledger.engine.sequence import SequenceStatus
from kvledger.entrypoint.check import check_prompt
from kvledger.state.directory import MemoryDirectory
from kvledger.state.ledger import StateLedger
from tests.engine.helpers import prompt

SPEC = ModelSpec.preset("tiny-v4")
PROMPT = [t % 32000 for t in prompt(700, seed=41)]   # 5 whole blocks; a snapshot hit of 4 (rule 3's cap: 512)


@pytest.fixture(scope="module")
def states():
    with StateLedger(SPEC, token="fetch-target-test", directory=MemoryDirectory(), capacity_bytes=1 << 26) as led:
        yield led


def _engine(ledger, states, **kw):
    from kvledger.engine.engine import Engine

    return Engine("tiny-v4", block_ledger=ledger, state_ledger=states, kv_cache_bytes=24 * SPEC.block_bytes(), **kw)


def _add(engine, ledger, rid, tokens, namespace="fetch-target", max_tokens=4):
    keys, decision = check_prompt(tokens, SPEC, block_ledger=ledger, state_ledger=engine.loader.state_ledger,
                                  namespace=namespace)
    engine.add_request(EngineRequest(rid, tokens, keys, decision, SamplingParams(max_tokens=max_tokens),
                                     namespace=namespace))
    return decision


def _drain(engine):
    while engine.has_unfinished():
        engine.step()


def test_an_aborted_loading_request_leaves_its_blocks_to_the_fetcher_until_its_job_ends(ledger, states):
    warm = _engine(ledger, states)
    try:
        _add(warm, ledger, "warm", PROMPT)
        _drain(warm)
        assert warm.wait_stored()
    finally:
        warm.close()
    engine = _engine(ledger, states, fetch_timeout_s=120.0)
    assert isinstance(engine.fetch_target, PoolTarget)
    stopped = True
    os.kill(engine.fetcher.pid, signal.SIGSTOP)
    try:
        assert _add(engine, ledger, "r1", PROMPT).block_hit_tokens == 512
        engine.step()
        seq = engine.scheduler.find("r1")
        assert seq.status is SequenceStatus.LOADING
        rows = list(seq.fetch_job.rows)
        assert rows == seq.block_table[:4]   # the fetcher writes the sequence's own blocks, nothing in between
        engine.abort("r1")
        engine.step()
        assert engine.orphans and all(engine.pool.blocks[b].ref_count == 1 for b in rows)
        assert not set(rows) & set(engine.pool.free_queue)
        _add(engine, ledger, "r2", PROMPT, namespace="other", max_tokens=8)   # takes every block it can get
        engine.step()
        assert not set(rows) & set(engine.scheduler.find("r2").block_table)
        os.kill(engine.fetcher.pid, signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 30
        while engine.orphans and time.monotonic() < deadline:   # the job ends; the next step lets the rows go
            engine.step()
            time.sleep(0.01)
        assert not engine.orphans and all(engine.pool.blocks[b].ref_count == 0 for b in rows)
        _drain(engine)
        engine.check_integrity()
        assert engine.pool.counts()[2] == 0
    finally:
        if stopped:
            os.kill(engine.fetcher.pid, signal.SIGCONT)
        engine.close()


def test_a_hit_read_into_the_pool_is_the_hit_through_staging(ledger, states):
    """Both targets give tiny-v4 (deterministic on every path) the same tokens for the same hit."""
    warm = _engine(ledger, states)
    try:
        _add(warm, ledger, "warm", PROMPT, namespace="both")
        _drain(warm)
        assert warm.wait_stored()
    finally:
        warm.close()
    outs = {}
    for into in ("pool", "staging"):
        engine = _engine(ledger, states, fetch_into=into)
        try:
            _add(engine, ledger, into, PROMPT, namespace="both", max_tokens=8)
            tokens = []
            while engine.has_unfinished():
                for ev in engine.step():
                    tokens += ev.token_ids
                    if ev.finished:
                        assert ev.usage.cached_tokens == 512 and ev.usage.fetch_bytes == 4 * SPEC.block_bytes()
            outs[into] = tokens
            engine.check_integrity()
        finally:
            engine.close()
    assert outs["pool"] == outs["staging"] and len(outs["pool"]) == 8
