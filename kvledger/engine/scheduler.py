"""The scheduler: which sequences run in the next step, and how many tokens each computes.

One step is one forward over a mixed batch (continuous batching): first one token for every
decoding sequence, then prefill chunks for sequences still prefilling, then new sequences
admitted from the waiting queue while `max_num_seqs` and the token budget
(`max_num_batched_tokens`) allow. A sequence whose hit blocks are still being fetched (LOADING)
holds its place but computes nothing until they arrive; prefills of others go on meanwhile.

Admission asks the engine (`admit`), which allocates the blocks, the slot and starts the fetch;
it answers False when the resources are not there, and the queue waits (first come, first served).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvledger.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        assert max_num_seqs > 0 and max_num_batched_tokens > 0
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, admit: Callable[[Sequence], bool]) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) for this step; empty when nothing can run now."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.status is Status.RUNNING and not seq.in_prefill and budget > 0:
                batch.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.status is Status.RUNNING and seq.in_prefill and budget > 0:
                n = min(seq.prompt_len - seq.computed, budget)
                batch.append((seq, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.status is Status.RUNNING and budget > 0:
                n = min(seq.prompt_len - seq.computed, budget)
                batch.append((seq, n))
                budget -= n
        return batch

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
