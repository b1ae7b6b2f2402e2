"""What the engine writes back (rules 4 and 7): new full blocks to the block ledger, snapshots to the state ledger.

    | when                  | block ledger                        | state ledger                          |
    |-----------------------|-------------------------------------|---------------------------------------|
    | prefill reaches k·P   | —                                   | window at k·P (checkpoint_positions)  |
    | prefill done          | full prompt blocks [hit/B, L/B)     | windows at prefill_store_positions(L) |
    | decode crosses k·B    | —                                   | window at k·B → the slot's replica    |
    | request end           | full blocks [L/B, computed/B)       | the latest replica, at its boundary   |

Rule 9: a sequence that is not exact (`Sequence.exact`: a window was truncated) stores nothing; nor does one that
does not store (rule 12: a no-store request, or one whose tenant was forgotten while it ran). `Sequence.keeps` says
both.

Blocks are copied from the device to host memory on the engine's thread, at `flush()`: `store_blocks` only
notes them, and the engine flushes before it next allocates a block (the start of a step), so a step's copies
can wait until its events are out (`Engine.step(defer_stores=True)`: a prefill's first token does not wait on
copying its blocks, 53 MB for a SmolLM2 prompt of 2,304 tokens). `put_chain` runs on a writer thread, so the
engine never waits on the disk. `wait()` blocks until every put noted before the call is done (a prefill leg's
end, tests, the demo's next turn); puts noted later do not lengthen it. A failed put is logged by the ledger and
counted there; nothing here raises (rule 8).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import NamedTuple

import numpy as np
import torch

from kvledger.core import PUBLIC_NAMESPACE, continue_chain, prefill_store_positions, tenant_of
from kvledger.engine.models.base import Model
from kvledger.engine.sequence import Sequence
from kvledger.engine.state_slots import StateSlots

log = logging.getLogger(__name__)


class _Export(NamedTuple):
    """A put whose blocks are still in the device pool, to be copied out at `flush()`."""

    block_ids: list[int]
    keys: list[bytes]
    start_pos: int
    parent: bytes | None
    namespace: str
    ttl_class: str | None


class PutJob(NamedTuple):
    keys: list[bytes]
    blocks: np.ndarray       # uint8 [n, block_bytes]
    start_pos: int
    parent: bytes | None
    namespace: str
    ttl_class: str | None


class LedgerWriter:
    def __init__(self, model: Model, block_ledger: object | None, state_ledger: object | None,
                 slots: StateSlots) -> None:
        self.model, self.spec, self.slots = model, model.spec, slots
        self.block_ledger, self.state_ledger = block_ledger, state_ledger
        self.queue: queue.Queue[PutJob | None] = queue.Queue()
        self.blocks_written = 0
        self._done = threading.Condition()
        self._queued = self._finished = 0   # puts queued (noted ones included) / finished so far (FIFO)
        self._exports: list[_Export] = []   # puts noted since the last flush, in order
        self._skipping: set[str] = set()     # tenants being forgotten: their queued puts are dropped (`forget`)
        self._skipped: dict[str, int] = {}   # ... and how many were
        self.thread = threading.Thread(target=self._run, name="kvledger-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            tenant = tenant_of(job.namespace)
            try:
                if tenant in self._skipping:
                    self._skipped[tenant] = self._skipped.get(tenant, 0) + 1
                    continue
                result = self.block_ledger.put_chain(job.keys, list(job.blocks), namespace=job.namespace,
                                                     start_pos=job.start_pos, parent=job.parent,
                                                     ttl_class=job.ttl_class)
                self.blocks_written += result.written
            except Exception:  # noqa: BLE001 - a store fault is a later miss (rule 8), never an engine error
                log.exception("put_chain failed")
            finally:
                with self._done:
                    self._finished += 1
                    self._done.notify_all()

    def export_blocks(self, block_ids: list[int]) -> np.ndarray:
        """uint8 [n, block_bytes]: each block's layers concatenated in layer order (models/base.py)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.model.device)
        parts = [c.blocks_u8()[ids] for c in self.model.caches if c.block_bytes]
        return torch.cat(parts, dim=1).cpu().numpy()

    def ensure_keys(self, seq: Sequence, n_blocks: int) -> None:
        """Extend the sequence's chain keys to `n_blocks` full blocks (decode blocks, rule 7)."""
        if n_blocks <= len(seq.keys):
            return
        seq.keys[:] = continue_chain(seq.tokens, self.spec, seq.request.namespace, seq.keys,
                                     public_blocks=seq.request.public_blocks, upto=n_blocks)

    def store_blocks(self, seq: Sequence, upto: int) -> None:
        """Queue blocks [seq.stored_blocks, upto) of the sequence for the block ledger (none of a sequence
        that does not keep what it computes: `Sequence.keeps`, rules 9 and 12)."""
        first = seq.stored_blocks
        if upto <= first or not seq.keeps:
            return
        self.ensure_keys(seq, upto)
        seq.stored_blocks = upto
        if self.block_ledger is None:
            return
        public = seq.request.public_blocks   # a public prefix's blocks are the public namespace's (rule 12)
        for lo, hi, namespace in ((first, min(upto, public), PUBLIC_NAMESPACE),
                                  (max(first, public), upto, seq.request.namespace)):
            if lo < hi:
                with self._done:
                    self._queued += 1
                self._exports.append(_Export(seq.block_table[lo:hi], seq.keys[lo:hi], lo,
                                             seq.keys[lo - 1] if lo else None, namespace, seq.request.ttl_class))

    def flush(self) -> None:
        """Copy the blocks of the puts noted since the last flush out of the device pool and queue them, in order.
        On the engine's thread, before it allocates a block again (the blocks of a finished sequence stay as
        they are until then)."""
        exports, self._exports = self._exports, []
        for e in exports:
            try:
                blocks = self.export_blocks(e.block_ids)
            except Exception:  # noqa: BLE001 - a lost put is a later miss (rule 8), never an engine error
                log.exception("copying blocks out for the block ledger failed")
                with self._done:
                    self._finished += 1
                    self._done.notify_all()
                continue
            self.queue.put(PutJob(e.keys, blocks, e.start_pos, e.parent, e.namespace, e.ttl_class))

    def store_prefill_snapshots(self, seq: Sequence) -> None:
        """Rule 4: the windows at the prompt's own cap and at its last boundary (`Sequence.keeps` only). A
        position before the hit's resume point is the hit's own, stored by whoever computed it, and this
        sequence never held its window (a P/D decode leg resuming at L − 1 from a handed tail)."""
        if self.state_ledger is None or not self.spec.has_swa or not seq.keeps:
            return
        for position in prefill_store_positions(seq.prompt_len, self.spec):
            if position >= seq.decision.recompute_from:
                self._put_window(seq, position)

    def store_checkpoint(self, seq: Sequence, position: int) -> None:
        """Rules 4′ and 4″: the window at `position`, where a prefill chunk just ended (`Sequence.keeps` only)."""
        if self.state_ledger is None or not seq.keeps:
            return
        assert seq.computed == position
        self._put_window(seq, position, extra=True)

    def _put_window(self, seq: Sequence, position: int, *, extra: bool = False) -> None:
        """The slot's window ending at `position` (a multiple of B its ring still holds) to the state ledger;
        `extra`: a checkpoint (rules 4′, 4″), first to be evicted."""
        assert self.state_ledger is not None and position % self.spec.block_size == 0
        self.model.export_window(seq.slot, position, self.slots.staging)
        block = position // self.spec.block_size - 1
        self.state_ledger.put(seq.keys[block], position, self.slots.staging.numpy(), seq.owner(block), extra=extra)

    def store_replica(self, seq: Sequence) -> None:
        """Rule 4 at request end: the latest decode replica, attached at its boundary (`Sequence.keeps` only)."""
        position = self.slots.replica_position[seq.slot] if seq.slot >= 0 else 0
        if self.state_ledger is None or position == 0 or not seq.keeps:
            return
        self.ensure_keys(seq, position // self.spec.block_size)
        block = position // self.spec.block_size - 1
        self.state_ledger.put(seq.keys[block], position, self.slots.replica[seq.slot].numpy(), seq.owner(block))

    def forget(self, tenant: str, timeout_s: float) -> tuple[int, bool]:
        """A forget of `tenant` (DESIGN rule 12), on the engine's thread: its puts noted and not yet copied are
        dropped, and those already queued are skipped by the writer thread, which this waits for (at most
        `timeout_s` seconds). (puts dropped, whether every put queued before is done.)"""
        mine = [e for e in self._exports if tenant_of(e.namespace) == tenant]
        self._exports = [e for e in self._exports if tenant_of(e.namespace) != tenant]
        with self._done:
            self._finished += len(mine)
            self._done.notify_all()
        self._skipping.add(tenant)
        try:
            drained = self.wait(timeout_s)
        finally:
            self._skipping.discard(tenant)
        return len(mine) + self._skipped.pop(tenant, 0), drained

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every put queued before this call is on the ledger (or failed: rule 8), at most `timeout_s`
        seconds (None: no bound); whether they all were."""
        with self._done:
            target = self._queued
            return self._done.wait_for(lambda: self._finished >= target, timeout_s)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(30)
