"""The ledger writer's wait: bounded, and blind to puts queued after it began (a prefill leg's end waits for its
own blocks, not for every later request's); a step's block copies left until its events are out."""

import threading
import time

from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.engine.engine import Engine
from kvledger.entrypoint.check import check_prompt
from kvledger.store.ledger import BlockLedger

from .helpers import drain, prompt


def test_wait_stored_is_bounded_and_waits_only_for_what_was_queued_before(tmp_path):
    with BlockLedger.open(path=tmp_path, fsync=False) as ledger:
        engine = Engine("tiny-v4", block_ledger=ledger)
        permits = threading.Semaphore(0)   # one per put allowed through: a store that hangs until told
        real_put = ledger.put_chain

        def held_put(*args, **kw):
            permits.acquire(timeout=30)
            return real_put(*args, **kw)

        def run(request_id: str, seed: int) -> list[bytes]:
            tokens = [t % 32000 for t in prompt(300, seed)]
            keys, decision = check_prompt(tokens, engine.spec, block_ledger=ledger, state_ledger=None)
            engine.add_request(EngineRequest(request_id, tokens, keys, decision,
                                             SamplingParams(max_tokens=2, ignore_eos=True)))
            drain(engine)
            return keys

        ledger.put_chain = held_put
        try:
            a = run("a", 1)
            t0 = time.monotonic()
            assert engine.wait_stored(0.3) is False            # a's put hangs: the wait ends, and says so
            assert 0.25 < time.monotonic() - t0 < 5
            waited: list[bool] = []
            waiter = threading.Thread(target=lambda: waited.append(engine.wait_stored(20)))
            waiter.start()                                     # waits for a's put only
            b = run("b", 2)                                    # queued after the wait began, and held
            permits.release()                                  # a's put goes through; b's still hangs
            waiter.join(20)
            assert waited == [True] and ledger.match(a) == len(a) == 2
            assert ledger.match(b) == 0
            permits.release()
            assert engine.wait_stored(20) is True and ledger.match(b) == 2
        finally:
            for _ in range(4):
                permits.release()
            engine.close()


def test_a_step_can_leave_its_block_copies_until_its_events_are_out(tmp_path):
    """`step(defer_stores=True)` (the async engine's, which delivers the events first) notes a prefill's blocks
    and copies them out at `flush_stores()`; the next step flushes what is left before it allocates. The blocks
    stored are the ones computed, whichever way."""
    with BlockLedger.open(path=tmp_path, fsync=False) as ledger:
        engine = Engine("tiny-v4", block_ledger=ledger)
        copied: list[list[int]] = []
        export = engine.writer.export_blocks
        engine.writer.export_blocks = lambda ids: copied.append(list(ids)) or export(ids)
        def add(request_id: str, seed: int) -> list[bytes]:
            tokens = [t % 32000 for t in prompt(300, seed)]
            keys, decision = check_prompt(tokens, engine.spec, block_ledger=ledger, state_ledger=None)
            engine.add_request(EngineRequest(request_id, tokens, keys, decision,
                                             SamplingParams(max_tokens=3, ignore_eos=True)))
            return keys

        try:
            a = add("a", 3)
            first = engine.step(defer_stores=True)
            assert len(first) == 1 and len(first[0].token_ids) == 1   # a's first token, out of this step
            assert copied == []                                # the prefill's 2 blocks: noted, not yet copied
            engine.flush_stores()
            assert copied == [copied[0]] and len(copied[0]) == 2
            assert engine.wait_stored(20) is True and ledger.match(a) == 2
            drain(engine)                                      # plain steps: each copies before it returns
            b = add("b", 4)
            engine.step(defer_stores=True)
            assert len(copied) == 1                            # b's blocks: noted
            engine.step()                                      # the next step copies them before anything else
            assert len(copied) == 2 and len(copied[1]) == 2
            drain(engine)
            assert engine.wait_stored(20) is True and ledger.match(b) == 2
        finally:
            engine.close()


def test_a_no_store_request_leaves_no_block_snapshot_or_device_entry(tmp_path):
    """DESIGN rule 12: a request with `store=False` computes as any other, and nothing it computed stays: no block
    in the ledger, no snapshot in the pool or on disk, no key in the device prefix cache. The same prompt stored
    normally afterwards lands in all three."""
    from kvledger.core import ModelSpec
    from kvledger.engine.ledgers import Part, open_ledgers
    from kvledger.store.snapshots import snapshot_stats

    engine = None
    ledgers = open_ledgers(ModelSpec.preset("tiny-v4"), tmp_path, Part.EMBEDDED)
    try:
        engine = Engine("tiny-v4", block_ledger=ledgers.block, state_ledger=ledgers.state)
        tokens = [t % 32000 for t in prompt(700, 5)]

        def run(request_id: str, store: bool) -> list[int]:
            keys, decision = check_prompt(tokens, engine.spec, block_ledger=ledgers.block, state_ledger=ledgers.state)
            engine.add_request(EngineRequest(request_id, tokens, keys, decision,
                                             SamplingParams(max_tokens=3, ignore_eos=True), store=store))
            out, _ = drain(engine)
            engine.wait_stored()
            return out

        quiet = run("quiet", False)
        keys, _ = check_prompt(tokens, engine.spec, block_ledger=ledgers.block, state_ledger=ledgers.state)
        assert ledgers.block.match(keys) == 0 and len(ledgers.state.pool) == 0
        assert snapshot_stats(tmp_path / "blocks") == (0, 0) and engine.pool.counts()[1] == 0
        assert run("normal", True) == quiet                   # the same answer; now it stays
        assert ledgers.block.match(keys) == len(keys) == 5 and len(ledgers.state.pool) > 0
        assert snapshot_stats(tmp_path / "blocks")[0] > 0 and engine.pool.counts()[1] > 0
    finally:
        if engine is not None:
            engine.close()
        ledgers.close()


def test_forget_on_the_engine_clears_its_caches_and_stops_a_running_requests_writes(tmp_path):
    """`Engine.forget` (DESIGN rule 12): the tenant's device prefix cache entries and host pool snapshots go, a
    request of it still waiting or running computes on and stores nothing, another tenant keeps everything."""
    from kvledger.core import ModelSpec
    from kvledger.engine.ledgers import Part, open_ledgers

    engine = None
    ledgers = open_ledgers(ModelSpec.preset("tiny-v4"), tmp_path, Part.EMBEDDED)
    try:
        engine = Engine("tiny-v4", block_ledger=ledgers.block, state_ledger=ledgers.state)

        def add(request_id: str, seed: int, namespace: str) -> list[bytes]:
            tokens = [t % 32000 for t in prompt(700, seed)]
            keys, decision = check_prompt(tokens, engine.spec, block_ledger=ledgers.block,
                                          state_ledger=ledgers.state, namespace=namespace)
            engine.add_request(EngineRequest(request_id, tokens, keys, decision,
                                             SamplingParams(max_tokens=2, ignore_eos=True), namespace=namespace))
            return keys

        stored, other = add("a", 1, "acme"), add("o", 2, "other")
        drain(engine)
        engine.wait_stored()
        late = add("b", 3, "acme#salt-0123")            # a salted namespace of acme's, not begun yet
        counts = engine.forget("acme")
        assert counts["running_requests"] == 1 and counts["device_blocks"] == 5 and counts["host_snapshots"] >= 1
        assert counts["writes_pending"] == 0
        drain(engine)
        engine.wait_stored()
        assert ledgers.block.match(late) == 0                      # b computed, and kept nothing
        assert engine.pool.cached_prefix(stored) == engine.pool.cached_prefix(late) == 0
        assert engine.pool.cached_prefix(other) == 5 and ledgers.state.positions(other)
        assert not ledgers.state.positions(stored) and not ledgers.state.positions(late)
    finally:
        if engine is not None:
            engine.close()
        ledgers.close()
