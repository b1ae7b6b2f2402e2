"""Admission is fair across tenants: one tenant's flood of waiting requests does not put another's behind all of it."""

from types import SimpleNamespace

from kvledger.core import salted_namespace
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import SequenceStatus


def _seq(request_id: str, namespace: str) -> SimpleNamespace:
    """What the scheduler reads of a Sequence: a one-token prompt, admitted straight to RUNNING."""
    return SimpleNamespace(request_id=request_id, request=SimpleNamespace(namespace=namespace),
                           status=SequenceStatus.RUNNING, in_prefill=True, prompt_len=1, computed=0,
                           prefill_chunk=lambda budget: min(1, budget))


def _admitted(scheduler: Scheduler) -> list[str]:
    return [seq.request_id for seq, _ in scheduler.schedule(lambda seq: True)]


def test_a_second_tenant_is_admitted_before_the_first_tenants_flood():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(8):
        scheduler.add(_seq(f"a{i}", "alpha"))
    scheduler.add(_seq("b0", "beta"))
    assert _admitted(scheduler) == ["a0", "b0"]


def test_tenants_take_turns_and_each_keeps_its_own_order():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    for rid, ns in (("a0", "alpha"), ("a1", "alpha"), ("a2", "alpha"), ("b0", "beta"), ("c0", "gamma"),
                    ("b1", "beta")):
        scheduler.add(_seq(rid, ns))
    assert _admitted(scheduler) == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_cache_salts_do_not_make_one_tenant_many():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        scheduler.add(_seq(f"a{i}", salted_namespace("alpha", f"salt-{i}")))
    scheduler.add(_seq("b0", "beta"))
    assert _admitted(scheduler) == ["a0", "b0"]


def test_a_request_that_cannot_be_admitted_keeps_its_turn():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    for rid, ns in (("a0", "alpha"), ("b0", "beta")):
        scheduler.add(_seq(rid, ns))
    assert scheduler.schedule(lambda seq: False) == []
    assert _admitted(scheduler) == ["a0", "b0"]


def test_removed_and_found_while_waiting():
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    a0, a1, b0 = _seq("a0", "alpha"), _seq("a1", "alpha"), _seq("b0", "beta")
    for seq in (a0, a1, b0):
        scheduler.add(seq)
    assert scheduler.find("a1") is a1
    scheduler.remove(a0)
    scheduler.remove(b0)
    assert [s.request_id for s in scheduler.waiting] == ["a1"] and scheduler.has_unfinished()
    assert _admitted(scheduler) == ["a1"]
    assert not scheduler.waiting


def test_prefill_chunks_end_at_the_checkpoints():
    """Rule 4′ (periodic): a chunk ends at each checkpoint, where the engine exports the window; the budget
    still bounds every chunk."""
    from kvledger.core import HitDecision, HitKind
    from kvledger.engine.api import EngineRequest, SamplingParams
    from kvledger.engine.sequence import Sequence

    miss = HitDecision(HitKind.MISS, 0, 0, False, 0, None, 1920)
    seq = Sequence.from_request(EngineRequest("r", [5] * 2000, [], miss, SamplingParams(max_tokens=1)))
    seq.checkpoints = (512, 1024, 1536)
    chunks = []
    while seq.in_prefill:
        chunks.append(seq.prefill_chunk(700))
        seq.computed += chunks[-1]
    assert chunks == [512, 512, 512, 464]
    seq.computed = 0
    assert seq.prefill_chunk(300) == 300


def _preempt(seq) -> None:
    seq.status = SequenceStatus.WAITING


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    """vLLM v1's policy: the oldest running sequence that lacks a block preempts the newest (LIFO), which goes to
    the front of its tenant's FIFO; a step that preempted admits nobody."""
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c, d = (_seq(rid, "alpha") for rid in ("a", "b", "c", "d"))
    for seq in (a, b, c):
        scheduler.add(seq)
    assert _admitted(scheduler) == ["a", "b", "c"]
    scheduler.add(d)
    short = {"a"}   # a lacks a block until c is gone

    def reserve(seq) -> bool:
        return seq.request_id not in short or c not in scheduler.running

    batch = scheduler.schedule(lambda seq: True, reserve, _preempt)
    assert [s.request_id for s, _ in batch] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c", "d"] and c.status is SequenceStatus.WAITING
    c.status = SequenceStatus.RUNNING   # what admit does
    assert [s.request_id for s, _ in scheduler.schedule(lambda seq: True, lambda seq: True, _preempt)][-2:] == \
        ["c", "d"]


def test_the_newest_preempts_itself_when_it_is_the_one_short():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seq("a", "alpha"), _seq("b", "beta")
    scheduler.add(a)
    scheduler.add(b)
    assert _admitted(scheduler) == ["a", "b"]
    batch = scheduler.schedule(lambda seq: True, lambda seq: seq is not b, _preempt)
    assert [s.request_id for s, _ in batch] == ["a"] and scheduler.running == [a]
    assert list(scheduler.waiting) == [b] and b.status is SequenceStatus.WAITING
