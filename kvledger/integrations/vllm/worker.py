"""Worker side of the connector: blocks between the ledger and vLLM's paged KV cache.

One step, as vLLM drives it:

    start_load_kv        read every load's blocks into host rows (checksums verified); a block
                         that does not arrive intact, and every later block of its run, is failed
    wait_for_layer_load  before layer i computes: copy layer i of the loaded rows into vLLM blocks
    save_kv_layer        after layer i computes: copy layer i of the blocks to save into host rows
    wait_for_save        put the saved rows as chains (one segment per run), then the step ends
    get_block_ids_with_load_errors   the failed vLLM blocks: vLLM recomputes from the first one

Rule 8: a failed read never reaches attention (the block is reported, and vLLM discards the
step's output for that request and recomputes it); nothing computed after a failed block in the
same step is saved; a failed save is logged and the step goes on.

torch only (no vLLM import): the main suite drives it with plain tensors and records.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from kvledger.integrations.vllm.layout import KvLayout
from kvledger.integrations.vllm.records import BlockRun, StepPlan
from kvledger.store.ledger import BlockLedger

log = logging.getLogger("kvledger.vllm")


@dataclass(slots=True)
class Transfer:
    """One run and its host rows; `ok` blocks of a load arrived intact; `layers` copied so far."""

    run: BlockRun
    rows: torch.Tensor
    ok: int
    layers: set[str] = field(default_factory=set)


class WorkerSide:
    """Loads and saves for one worker; `layout` is set once vLLM registers its KV caches."""

    def __init__(self, ledger: BlockLedger, events: str | None = None) -> None:
        self.ledger = ledger
        self.events = events
        self.layout: KvLayout | None = None
        self.loads: list[Transfer] = []
        self.saves: list[Transfer] | None = None  # None until this step's saves are prepared
        self.plan = StepPlan()
        self.failed: set[int] = set()
        self.poisoned: dict[str, int] = {}  # req_id → first chain position not to save this step

    def register(self, layout: KvLayout) -> None:
        self.layout = layout

    # --- loads -------------------------------------------------------------------

    def start_step(self, plan: StepPlan) -> None:
        """Read this step's loads; blocks that fail are recorded, never copied."""
        self.plan, self.loads, self.saves = plan, [], None
        self.failed, self.poisoned = set(), {}
        for run in plan.loads:
            t0 = time.perf_counter()
            transfer = self._read(run)
            self.loads.append(transfer)
            if transfer.ok < len(run.keys):
                self.failed.update(run.block_ids[transfer.ok:])
                self.poisoned[run.req_id] = run.start + transfer.ok
            self._event("load", run, ok=transfer.ok, seconds=time.perf_counter() - t0)

    def _read(self, run: BlockRun) -> Transfer:
        assert self.layout is not None, "KV caches are registered before the first step"
        rows = self.layout.new_rows(len(run.keys))
        try:
            ok = self.ledger.read_prefix(run.keys, [rows[i].numpy() for i in range(len(run.keys))])
        except Exception as e:  # rule 8: an unreadable store is a miss
            log.warning("kvledger: load of %d blocks failed (%s); vLLM recomputes", len(run.keys), e)
            ok = 0
        return Transfer(run, rows, ok)

    def layer_loaded(self, name: str) -> None:
        """Copy layer `name` of every intact loaded block into vLLM's cache (before it computes)."""
        if self.layout is None or name not in self.layout.caches:
            return
        for t in self.loads:
            if name not in t.layers:
                self.layout.scatter(name, t.rows, t.run.block_ids[:t.ok])
                t.layers.add(name)

    # --- saves -------------------------------------------------------------------

    def _prepare_saves(self) -> list[Transfer]:
        """This step's save runs, minus what a failed load poisoned and what the ledger holds."""
        if self.saves is not None:
            return self.saves
        assert self.layout is not None
        self.saves = []
        for run in self.plan.saves:
            stop = self.poisoned.get(run.req_id)
            n = len(run.keys) if stop is None else max(min(stop - run.start, len(run.keys)), 0)
            for part in self._missing(run, n):
                self.saves.append(Transfer(part, self.layout.new_rows(len(part.keys)), len(part.keys)))
        return self.saves

    def _missing(self, run: BlockRun, n: int) -> list[BlockRun]:
        """The blocks among the first `n` of `run` the ledger lacks, as contiguous runs."""
        if n <= 0:
            return []
        try:
            present = self.ledger.exists(run.keys[:n])
        except Exception as e:
            log.warning("kvledger: CHECK before save failed (%s); skipping the save", e)
            return []
        parts: list[BlockRun] = []
        j = 0
        while j < n:
            if present[j]:
                j += 1
                continue
            k = j
            while k < n and not present[k]:
                k += 1
            parent = run.keys[j - 1] if j else run.parent
            parts.append(BlockRun(run.req_id, run.namespace, run.start + j, run.keys[j:k],
                                  run.block_ids[j:k], parent))
            j = k
        return parts

    def layer_computed(self, name: str) -> None:
        """Copy layer `name` of the blocks to save out of vLLM's cache (after it computed)."""
        if self.layout is None or name not in self.layout.caches or not self.plan.saves:
            return
        for t in self._prepare_saves():
            if name not in t.layers:
                self.layout.gather(name, t.run.block_ids, t.rows)
                t.layers.add(name)

    def finish_step(self) -> None:
        """Stage the layers not seen yet, then put each run as one chain."""
        if self.layout is not None and self.plan.saves:
            for name in self.layout.names:
                self.layer_computed(name)
            for t in self._prepare_saves():
                self._put(t)
        for t in self.loads:
            missing = set(self.layout.names) - t.layers if self.layout is not None else set()
            assert t.ok == 0 or not missing, f"layers never loaded: {sorted(missing)[:3]}"
        self.loads, self.saves, self.plan = [], None, StepPlan()

    def _put(self, t: Transfer) -> None:
        run = t.run
        t0 = time.perf_counter()
        try:
            result = self.ledger.put_chain(run.keys, [t.rows[i].numpy() for i in range(len(run.keys))],
                                           namespace=run.namespace, start_pos=run.start, parent=run.parent)
            ok = not getattr(result, "failed", 0)
        except Exception as e:  # rule 8: a failed save is a future miss
            log.warning("kvledger: save of %d blocks failed (%s)", len(run.keys), e)
            ok = False
        self._event("save", run, ok=len(run.keys) if ok else 0, seconds=time.perf_counter() - t0)

    def take_failed(self) -> set[int]:
        return set(self.failed)

    def _event(self, kind: str, run: BlockRun, *, ok: int, seconds: float) -> None:
        """One JSON line per transfer into the `events` file (appended; one write per line)."""
        if not self.events:
            return
        line = json.dumps({"event": kind, "req_id": run.req_id, "namespace": run.namespace, "start": run.start,
                           "blocks": len(run.keys), "ok": ok, "seconds": round(seconds, 6), "t": time.time()})
        fd = os.open(self.events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
