"""Where the fetcher reads a hit's blocks (rule 6), and who may reuse that memory when.

    | target         | used when            | a job's rows         | after the fetch                              |
    |----------------|----------------------|----------------------|----------------------------------------------|
    | `PoolTarget`   | the model on the CPU | the sequence's own   | nothing: the blocks are in place (no copy)   |
    |                |                      |   device blocks      |                                              |
    | `StagingTarget`| a device (CUDA)      | rows of a staging    | swap-in copies them layer by layer during    |
    |                |                      |   area, first fit    |   the first forward (`SwapIn`)               |

Invariant: while the fetcher may still write a job's rows, nothing else uses them. A job whose sequence goes away
before the job ends (abort, preemption) is an orphan: its rows stay held (`orphan`) until the job ends or the fetcher
is killed and reaped, and only then `release(job, orphaned=True)` lets them go.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from kvledger.engine.block_pool import BlockPool
from kvledger.engine.fetcher import FetchJob, Parts
from kvledger.engine.models.base import Model
from kvledger.engine.shared_area import SharedArea


class PoolTarget:
    """The device blocks themselves, in a shared area (`Model.allocate(·, ·, area)`): the fetcher writes each layer's
    part of a ledger block into that layer's block."""

    def __init__(self, model: Model, pool: BlockPool, num_blocks: int, area: SharedArea) -> None:
        self.pool, self.area = pool, area
        self.parts: Parts = model.block_parts(num_blocks)
        # per layer, the parts a forward needs in place before it computes that layer (a streamed hit): those of
        # the layers up to it that keep block KV
        self.parts_before = list(accumulate(1 if size else 0 for size in model.layer_block_bytes()))

    def rows(self, blocks: list[int]) -> list[int] | None:
        return list(blocks)

    def staged(self, job: FetchJob, take: int) -> np.ndarray | None:
        return None

    def orphan(self, job: FetchJob) -> None:
        self.pool.hold(job.rows)

    def release(self, job: FetchJob, *, orphaned: bool) -> None:
        if orphaned:
            self.pool.free(job.rows)


class StagingTarget:
    """A staging area of `capacity` whole blocks in host shared memory; rows are handed out first fit."""

    def __init__(self, block_bytes: int, capacity: int) -> None:
        assert block_bytes > 0 and capacity > 0
        self.block_bytes, self.capacity = block_bytes, capacity
        self.area = SharedArea(block_bytes * capacity, "kvledger-staging")
        self.parts: Parts = [(0, block_bytes)]
        self.staging = np.ndarray((capacity, block_bytes), dtype=np.uint8, buffer=self.area.buf)
        self.used: dict[int, tuple[int, int]] = {}   # first row → (first row, n), per job holding rows

    def rows(self, blocks: list[int]) -> list[int] | None:
        """A free run of len(blocks) staging rows, or None (try later)."""
        n = len(blocks)
        assert 0 < n <= self.capacity, "a job larger than the staging area"
        start = 0
        for first, count in sorted(self.used.values()):
            if first - start >= n:
                break
            start = max(start, first + count)
        if self.capacity - start < n:
            return None
        self.used[start] = (start, n)
        return list(range(start, start + n))

    def staged(self, job: FetchJob, take: int) -> np.ndarray:
        """The job's first `take` blocks in staging: uint8 [take, block_bytes] (valid until `release`)."""
        return self.staging[job.rows[0]:job.rows[0] + take]

    def orphan(self, job: FetchJob) -> None:
        """Nothing to do: the rows stay in `used` until `release`."""

    def release(self, job: FetchJob, *, orphaned: bool) -> None:
        self.used.pop(job.rows[0], None)
