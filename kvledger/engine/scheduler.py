"""The scheduler: which sequences run in the next step, and how many tokens each computes.

One step is one forward over a mixed batch (continuous batching): first one token for every
decoding sequence, then prefill chunks for sequences still prefilling, then new sequences
admitted from the waiting queue while `max_num_seqs` and the token budget
(`max_num_batched_tokens`) allow. A sequence whose hit blocks are still being fetched (LOADING)
holds its place but computes nothing until they arrive; prefills of others go on meanwhile.

Admission asks the engine (`admit`), which allocates the blocks, the slot and starts the fetch;
it answers False when the resources are not there, and the queue waits.

Preemption by recompute (as vLLM v1's scheduler does it, FCFS policy): before the batch is built, each
running sequence, in admission order, gets the blocks its next step computes (`reserve`). When the pool
has none, the most recently admitted running sequence is preempted (LIFO; it may be the one asking,
and then it waits too): `preempt` gives back its blocks and slot, and it goes to the FRONT of its
tenant's FIFO, so it is readmitted before that tenant's newer requests. A step that preempted admits
nobody. The oldest running sequence is never preempted while another runs, and alone it fits the pool
(the engine refuses any request that does not), so it always progresses: no livelock. The waiting queue is fair
across tenants (`FairQueue`): one FIFO per tenant, served in turn, so one tenant's flood of waiting
requests delays another's by at most one admission per tenant ahead of it, never by the whole flood.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from kvledger.core import tenant_of
from kvledger.engine.sequence import Sequence, SequenceStatus


class FairQueue:
    """Waiting sequences, one FIFO per tenant (`core.tenant_of` its namespace: cache salts do not make more
    tenants), tenants in turn. Example: A1 A2 A3 B1 added in that order leave as A1 B1 A2 A3.

    Invariants: no tenant has an empty FIFO here; the dict's order is the turn order, its first tenant is
    served next, and a tenant that is served goes to the end of the turn."""

    def __init__(self) -> None:
        self._fifos: dict[str, deque[Sequence]] = {}

    def append(self, seq: Sequence) -> None:
        self._fifos.setdefault(tenant_of(seq.request.namespace), deque()).append(seq)

    def appendleft(self, seq: Sequence) -> None:
        """At the front of its tenant's FIFO (a preempted sequence); the tenant's turn is unchanged (or last, new)."""
        self._fifos.setdefault(tenant_of(seq.request.namespace), deque()).appendleft(seq)

    def peek(self) -> Sequence | None:
        """The next sequence to admit (None: none waits)."""
        return next(iter(self._fifos.values()))[0] if self._fifos else None

    def pop(self) -> Sequence:
        """Take `peek()`'s sequence; its tenant's turn moves to the end."""
        tenant, fifo = next(iter(self._fifos.items()))
        seq = fifo.popleft()
        del self._fifos[tenant]
        if fifo:
            self._fifos[tenant] = fifo
        return seq

    def remove(self, seq: Sequence) -> None:
        tenant = tenant_of(seq.request.namespace)
        fifo = self._fifos[tenant]
        fifo.remove(seq)
        if not fifo:
            del self._fifos[tenant]

    def __contains__(self, seq: object) -> bool:
        return any(seq in fifo for fifo in self._fifos.values())

    def __iter__(self) -> Iterator[Sequence]:
        for fifo in self._fifos.values():
            yield from fifo

    def __len__(self) -> int:
        return sum(len(fifo) for fifo in self._fifos.values())


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting = FairQueue()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, admit: Callable[[Sequence], bool], reserve: Callable[[Sequence], bool] | None = None,
                 preempt: Callable[[Sequence], None] | None = None) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) for this step; empty when nothing can run now. Without `reserve`,
        admission reserved everything and nothing is preempted."""
        preempted = self._reserve(reserve, preempt) if reserve is not None else False
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.status is SequenceStatus.RUNNING and not seq.in_prefill and budget > 0:
                batch.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.status is SequenceStatus.RUNNING and seq.in_prefill and budget > 0:
                n = seq.prefill_chunk(budget)
                batch.append((seq, n))
                budget -= n
        while not preempted and (seq := self.waiting.peek()) is not None and len(self.running) < self.max_num_seqs:
            if not admit(seq):   # the resources are not there: it waits, and its turn with it
                break
            self.waiting.pop()
            self.running.append(seq)
            if seq.status is SequenceStatus.RUNNING and budget > 0:
                n = seq.prefill_chunk(budget)
                batch.append((seq, n))
                budget -= n
        return batch

    def _reserve(self, reserve: Callable[[Sequence], bool], preempt: Callable[[Sequence], None] | None) -> bool:
        """Blocks for every running sequence's next step, oldest first, preempting LIFO (module docstring);
        whether any sequence was preempted. Sequences already served are never the victim: it is always the
        last of `running`, and the loop stops when the one asking is preempted."""
        assert preempt is not None, "a scheduler that reserves must be able to preempt"
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while seq.status is SequenceStatus.RUNNING and not reserve(seq):
                victim = self.running.pop()
                preempt(victim)
                self.waiting.appendleft(victim)
                preempted = True
                if victim is seq:
                    break
            i += 1
        return preempted

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
