"""Worker side of the connector: blocks between the ledger and vLLM's paged KV cache.

One step, as vLLM drives it:

    start_load_kv        hand this step's loads to a copier thread (engine/swapin.py) and return:
                         the thread reads each run into reused host rows (one read per segment
                         run, each block's xxh3 checked once), then copies layer 0 of every intact
                         block into vLLM's blocks, signals, copies layer 1, … while the model computes
    wait_for_layer_load  before layer i's attention: wait until layer i is copied (usually done)
    save_kv_layer        after layer i computes: copy layer i of the blocks to save into host rows
    wait_for_save        the copier has ended; put the saved rows as chains (one segment per run)
    get_block_ids_with_load_errors   the failed vLLM blocks: vLLM recomputes from the first one

A hybrid model's step also moves windows (`WindowRun`: the sliding-window layers' blocks around
a snapshot position) between the state ledger's snapshot files and vLLM's sliding-window groups:
a window load reads the whole snapshot and writes it at once in `start_load_kv` (its request is
waiting for this asynchronous load, not in the step's forward), a window save copies the blocks
out in `wait_for_save`, after the forward wrote them. Its loads are reported per request
(`take_transfer_results`: finished, failed), never as block ids (vLLM's hybrid manager takes none).

A snapshot's bytes, n = len(window) blocks, the windowed layers in model order:

    row j (window block j) = | SWA layer a's slice of block j | SWA layer b's | … |   (n rows, back to back)

Under tensor or pipeline parallelism each worker moves its own slice of a block (`slices.py`): it saves its
part under the part's key (a replicated head only from its first replica), and loads from the partition the
scheduler's CHECK found whole (`BlockRun.sources`): its own part straight into its host rows, or the parts of
another engine's partition that hold its heads, each copied into place.

Rule 8: a block that does not arrive intact, and every later block of its run, is never copied
and is reported (vLLM discards the step's output for that request and recomputes it); nothing
computed after a failed block in the same step is saved; a load that does not finish within
`LOAD_WAIT_S` is abandoned whole (its copier cancelled: it writes no vLLM block once the step
has moved on) and reported; a failed save is logged and the step goes on.

torch only (no vLLM import): the main suite drives it with plain tensors and records.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvledger.engine.swapin import SwapIn, SwapItem
from kvledger.integrations.vllm.events import EventLog
from kvledger.integrations.vllm.layout import KvLayout
from kvledger.integrations.vllm.records import BlockRun, StepPlan, WindowRun
from kvledger.integrations.vllm.slices import Slicing
from kvledger.state.ledger import StateLedger
from kvledger.store.ledger import BlockLedger

log = logging.getLogger("kvledger.vllm")

LOAD_WAIT_S = 30.0                 # a load not read and copied by then is abandoned (rule 8: a miss, never a hang)
KEEP_STAGING_BYTES = 512 << 20     # host rows up to this size are kept for the next step (no page faults)


@dataclass(slots=True)
class Transfer:
    """One run and its host rows; `ok` leading blocks arrived intact (loads) or are to be put (saves);
    `seconds` the read's wall time; `layers` the layers staged so far (saves)."""

    run: BlockRun
    rows: torch.Tensor
    ok: int
    seconds: float = 0.0
    layers: set[str] = field(default_factory=set)


class Staging:
    """Reused host rows of whole blocks (uint8, one row per block), pinned when the KV is on a GPU."""

    def __init__(self, block_bytes: int, pin: bool) -> None:
        self.block_bytes, self.pin = block_bytes, pin
        self.buf = torch.empty((0, block_bytes), dtype=torch.uint8)

    def rows(self, counts: list[int]) -> list[torch.Tensor]:
        """One slice of rows per count, back to back; valid until the next call."""
        total = sum(counts)
        buf = self.buf
        if buf.shape[0] < total:
            buf = torch.empty((total, self.block_bytes), dtype=torch.uint8, pin_memory=self.pin)
            if total * self.block_bytes <= KEEP_STAGING_BYTES:
                self.buf = buf
        out, at = [], 0
        for n in counts:
            out.append(buf[at:at + n])
            at += n
        return out


class WorkerSide:
    """Loads and saves for one worker; `layout` is set once vLLM registers its KV caches."""

    def __init__(self, ledger: BlockLedger, events: EventLog | None = None, state: StateLedger | None = None,
                 slicing: Slicing | None = None) -> None:
        assert slicing is None or slicing.own is not None, "a worker's slicing names its own slice"
        self.ledger = ledger
        self.events = events
        self.state = state
        self.slicing = slicing   # None: the worker holds whole blocks, keyed by their chain keys
        self.partitions = slicing.partitions() if slicing is not None else ()
        self.layout: KvLayout | None = None
        self.windows: KvLayout | None = None   # the sliding-window layers (a hybrid model)
        self.window_group: dict[str, int] = {}  # SWA layer name → its group's index in WindowRun.block_ids
        self.finished_requests: set[str] = set()  # by-request loads done this step (reported once)
        self.failed_requests: set[str] = set()    # … and those of them that failed
        self.loads: list[Transfer] = []
        self.swap: SwapIn | None = None
        self.settled = True        # this step's load outcomes are in `failed` and `poisoned`
        self.abandoned = False     # this step's loads were given up (all reported, the copier cancelled)
        self.saves: list[Transfer] | None = None  # None until this step's saves are prepared
        self.plan = StepPlan()
        self.failed: set[int] = set()
        self.poisoned: dict[str, int] = {}  # req_id → first chain position not to save this step

    def register(self, layout: KvLayout, windows: KvLayout | None = None,
                 window_group: dict[str, int] | None = None) -> None:
        """`layout`: the layers a ledger block holds; `windows`: the sliding-window layers, each in the
        group `window_group[name]` (an index into `WindowRun.block_ids`)."""
        assert (windows is None) == (self.state is None), "sliding-window layers iff a state ledger"
        self.layout, self.windows, self.window_group = layout, windows, dict(window_group or {})
        pin = layout.device.type == "cuda"
        self.load_rows, self.save_rows = Staging(layout.block_bytes, pin), Staging(layout.block_bytes, pin)

    # --- loads -------------------------------------------------------------------

    def start_step(self, plan: StepPlan) -> None:
        """Start this step's loads in the copier thread; returns at once."""
        self._end_loads()  # a step vLLM did not finish (no wait_for_save) ends here
        self.plan, self.saves = plan, None
        self.failed, self.poisoned, self.abandoned = set(), {}, False
        self.loads = []
        if plan.by_request:
            self.finished_requests |= {run.req_id for run in plan.loads} | {w.req_id for w in plan.window_loads}
        for window in plan.window_loads:
            if not self._load_window(window):
                self.failed_requests.add(window.req_id)
        if not plan.loads:
            return
        assert self.layout is not None, "KV caches are registered before the first step"
        rows = self.load_rows.rows([len(run.keys) for run in plan.loads])
        self.loads = [Transfer(run, r, 0) for run, r in zip(plan.loads, rows)]
        self.settled = False
        self.swap = SwapIn(self.layout.layers, [], self.layout.device, fetch=self._fetch).start()

    def _own_keys(self, keys: tuple[bytes, ...]) -> list[bytes]:
        """The keys of this worker's part of the blocks under chain keys `keys`."""
        if self.slicing is None:
            return list(keys)
        own = self.slicing.own
        assert own is not None
        return [self.slicing.key(k, own) for k in keys]

    def _read(self, run: BlockRun, rows: torch.Tensor) -> int:
        """Read this worker's part of the run's blocks into `rows`; the number of leading blocks that arrived
        intact. From the engine's own partition, one read of the run; from another, the parts holding this
        worker's heads, block by block, each copied into place (`Slicing.copy_part`)."""
        n = len(run.keys)
        if not any(run.sources):
            return self.ledger.read_prefix(self._own_keys(run.keys), [rows[i].numpy() for i in range(n)])
        assert self.slicing is not None, "a block from another partition is a sliced worker's"
        for j, (key, source) in enumerate(zip(run.keys, run.sources)):
            row = rows[j].numpy()
            parts = self.slicing.reads(self.partitions[source])
            if parts == (self.slicing.own,):
                ok = self.ledger.read_prefix([self.slicing.key(key, parts[0])], [row]) == 1
            else:
                bufs = [bytearray(self.slicing.part_bytes(s)) for s in parts]
                sizes = self.ledger.get_into([self.slicing.key(key, s) for s in parts], bufs)
                ok = all(size == len(buf) for size, buf in zip(sizes, bufs))
                for s, buf in zip(parts, bufs) if ok else ():
                    self.slicing.copy_part(np.frombuffer(buf, dtype=np.uint8), s, row)
            if not ok:
                return j
        return n

    def _fetch(self) -> list[SwapItem]:
        """In the copier thread: read every load; what arrived intact is copied, layer by layer."""
        items = []
        for t in self.loads:
            t0 = time.perf_counter()
            try:
                t.ok = self._read(t.run, t.rows)
            except Exception as e:  # rule 8: an unreadable store is a miss
                log.warning("kvledger: load of %d blocks failed (%s); vLLM recomputes", len(t.run.keys), e)
                t.ok = 0
            t.seconds = time.perf_counter() - t0
            items.append(SwapItem(t.rows[:t.ok].numpy(), list(t.run.block_ids[:t.ok])))
        return items

    def _load_window(self, w: WindowRun) -> bool:
        """Read the snapshot at `w.position` whole, check its size, write its blocks past `w.skip`."""
        assert self.state is not None and self.windows is not None, "a window load needs the state ledger"
        t0 = time.perf_counter()
        n = len(w.block_ids[0])
        buf = bytearray(n * self.windows.block_bytes)
        try:
            size = self.state.fetch_into(w.key, buf)
        except Exception as e:  # noqa: BLE001 - rule 8: an unreadable snapshot is a miss
            log.warning("kvledger: snapshot at %d unreadable (%s); vLLM recomputes", w.position, e)
            size = None
        ok = size == len(buf)
        if ok:
            rows = torch.frombuffer(buf, dtype=torch.uint8).view(n, self.windows.block_bytes)
            for name in self.windows.names:
                self.windows.scatter(name, rows[w.skip:], w.block_ids[self.window_group[name]][w.skip:])
        else:
            log.warning("kvledger: snapshot at %d of %s missing or of the wrong size (%s B, expected %d); "
                        "vLLM recomputes", w.position, w.req_id, size, len(buf))
        self._window_event("window_load", w, ok=ok, seconds=time.perf_counter() - t0)
        return ok

    def _save_window(self, w: WindowRun) -> None:
        """Copy the window's blocks out of vLLM's sliding-window groups and keep them as the snapshot."""
        assert self.state is not None and self.windows is not None
        t0 = time.perf_counter()
        rows = torch.empty((len(w.block_ids[0]), self.windows.block_bytes), dtype=torch.uint8)
        for name in self.windows.names:
            self.windows.gather(name, w.block_ids[self.window_group[name]], rows)
        try:
            ok = self.state.put(w.key, w.position, rows.numpy().reshape(-1))
        except Exception as e:  # noqa: BLE001 - rule 8: a failed save is a future miss
            log.warning("kvledger: snapshot save at %d failed (%s)", w.position, e)
            ok = False
        self._window_event("window_save", w, ok=ok, seconds=time.perf_counter() - t0)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """The by-request loads ended since the last call, and those of them that failed (each reported once)."""
        self._end_loads()
        done, failed = self.finished_requests, self.failed_requests
        self.finished_requests, self.failed_requests = set(), set()
        return done, failed

    def layer_loaded(self, name: str) -> None:
        """Before layer `name` computes: wait until its loaded blocks are in vLLM's cache."""
        if self.swap is None or self.abandoned or self.layout is None or name not in self.layout.index:
            return
        try:
            self.swap.before_layer(self.layout.index[name], LOAD_WAIT_S)
        except RuntimeError as e:
            self._abandon(f"layer {name}: {e}")

    def _abandon(self, why: str) -> None:
        """Give up this step's loads: the copier writes nothing more; every block of them is reported."""
        assert self.swap is not None, "only a step with loads abandons them"
        self.swap.cancel()
        if self.swap.thread.is_alive():  # a read may still land in these rows: the next step gets others
            self.load_rows = Staging(self.load_rows.block_bytes, self.load_rows.pin)
        log.warning("kvledger: load abandoned (%s); vLLM recomputes its %d blocks", why,
                    sum(len(t.run.keys) for t in self.loads))
        for t in self.loads:
            self._note_failed(t, 0)
        self.abandoned = self.settled = True

    def _settle(self) -> None:
        """Wait until the reads have ended, then note the failed blocks (once per step)."""
        if self.settled:
            return
        assert self.swap is not None, "an unsettled step has a copier"
        if not self.swap.fetched.wait(LOAD_WAIT_S):
            self._abandon(f"no read in {LOAD_WAIT_S:.0f} s")
            return
        self.settled = True
        for t in self.loads:
            if t.ok < len(t.run.keys):
                self._note_failed(t, t.ok)

    def _note_failed(self, t: Transfer, ok: int) -> None:
        """Blocks past the first `ok` of a load did not arrive: by block id, or (by request) the request."""
        if self.plan.by_request:
            self.failed_requests.add(t.run.req_id)
        else:
            self.failed.update(t.run.block_ids[ok:])
        self.poisoned[t.run.req_id] = t.run.start + ok

    def _end_loads(self) -> None:
        """The step ends: outcomes noted, the copier ended (or cancelled and reported), one event per load
        (`waited_s`: how long the forward blocked on this step's loads, the part compute did not hide)."""
        swap = self.swap
        if swap is None:
            return
        self._settle()
        if not self.abandoned:
            swap.thread.join(LOAD_WAIT_S)
            if swap.thread.is_alive() or swap.error is not None:
                self._abandon(f"copy: {swap.error or 'timeout'}")
        for t in self.loads:
            self._event("load", t.run, ok=0 if self.abandoned else t.ok, seconds=t.seconds, waited_s=swap.wait_s)
        self.swap = None

    # --- saves -------------------------------------------------------------------

    def _prepare_saves(self) -> list[Transfer]:
        """This step's save runs, minus what a failed load poisoned and what the ledger holds."""
        if self.saves is not None:
            return self.saves
        assert self.layout is not None
        self._settle()
        parts = []
        stores = self.slicing is None or self.slicing.stores   # a replica of heads another worker stores: none
        for run in self.plan.saves if stores else ():
            stop = self.poisoned.get(run.req_id)
            n = len(run.keys) if stop is None else max(min(stop - run.start, len(run.keys)), 0)
            parts += self._missing(run, n)
        rows = self.save_rows.rows([len(p.keys) for p in parts])
        self.saves = [Transfer(p, r, len(p.keys)) for p, r in zip(parts, rows)]
        return self.saves

    def _missing(self, run: BlockRun, n: int) -> list[BlockRun]:
        """The blocks among the first `n` of `run` the ledger lacks, as contiguous runs."""
        if n <= 0:
            return []
        try:
            present = self.ledger.exists(self._own_keys(run.keys[:n]))
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
        if self.layout is None or name not in self.layout.index or not self.plan.saves:
            return
        for t in self._prepare_saves():
            if name not in t.layers:
                self.layout.gather(name, t.run.block_ids, t.rows)
                t.layers.add(name)

    def finish_step(self) -> None:
        """End the loads, stage the layers not seen yet, then put each save run as one chain."""
        self._end_loads()
        if self.layout is not None and self.plan.saves:
            for name in self.layout.names:
                self.layer_computed(name)
            for t in self._prepare_saves():
                self._put(t)
        stores = self.slicing is None or self.slicing.stores   # a replica of another worker's heads: no save
        for w in self.plan.window_saves if stores else ():
            if w.req_id not in self.poisoned:   # computed on lost KV: not saved
                self._save_window(w)
        self.loads, self.saves, self.plan = [], None, StepPlan()

    def _put(self, t: Transfer) -> None:
        run = t.run
        t0 = time.perf_counter()
        parent = self._own_keys((run.parent,))[0] if run.parent is not None else None
        try:
            result = self.ledger.put_chain(self._own_keys(run.keys), [t.rows[i].numpy() for i in range(len(run.keys))],
                                           namespace=run.namespace, start_pos=run.start, parent=parent)
            ok = not getattr(result, "failed", 0)
        except Exception as e:  # rule 8: a failed save is a future miss
            log.warning("kvledger: save of %d blocks failed (%s)", len(run.keys), e)
            ok = False
        self._event("save", run, ok=len(run.keys) if ok else 0, seconds=time.perf_counter() - t0)

    def take_failed(self) -> set[int]:
        self._end_loads()
        return set(self.failed)

    def _window_event(self, kind: str, w: WindowRun, *, ok: bool, seconds: float) -> None:
        if self.events is not None:
            self.events.write({"event": kind, "req_id": w.req_id, "position": w.position,
                               "blocks": len(w.block_ids[0]), "ok": int(ok), "seconds": round(seconds, 6),
                               "t": time.time()})

    def _event(self, kind: str, run: BlockRun, *, ok: int, seconds: float, **extra: float) -> None:
        """One line per transfer in the event log (events.py; its namespace as a keyed digest, never in clear);
        a sliced worker's also says its slice, [head0, head1, layer0, layer1]."""
        if self.events is None:
            return
        sliced = {}
        if self.slicing is not None and self.slicing.own != self.slicing.everything:
            own = self.slicing.own
            assert own is not None
            sliced = {"slice": [own.head0, own.head1, own.layer0, own.layer1]}
        self.events.write({"event": kind, "req_id": run.req_id, "namespace_digest": self.events.digest(run.namespace),
                           "start": run.start, "blocks": len(run.keys), "ok": ok, "seconds": round(seconds, 6),
                           "t": time.time(), **sliced, **{k: round(v, 6) for k, v in extra.items()}})
