"""Layer-wise swap-in (rule 6): hit blocks go from host staging to the device caches layer by layer,
while earlier layers compute. The engine's forward and the vLLM connector's worker side share it.

A copier thread (optionally first fetching the blocks into staging: `fetch`) copies layer 0 of
every hit block, signals layer 0, copies layer 1, ... The forward calls `before_layer(l)` before
layer l reads its caches and blocks only if layer l is not copied yet; the time it blocks is the
swap-in the compute did not hide. On CUDA the copies run on a side stream and layer l's compute
waits on that stream's event (the host thread only issues them).

    copier thread:  [fetch] → copy layer 0 → set ready[0] → copy layer 1 → set ready[1] → …
    forward:        layer 0 projections → before_layer(0) → attention 0 → … → before_layer(1) → …

Layer l of block i sits at bytes [offset_l, offset_l + size_l) of the block (models/base.py).
After `cancel()` returns no copy is running or will start: a caller that gave up waiting may
reuse the staging and the destination blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

WAIT_LIMIT_S = 60.0


class BlockSink(Protocol):
    """One layer's device KV, as the swap-in writes it (the engine's `LayerCache`, the vLLM layout's layers)."""

    block_bytes: int  # ledger bytes of one block for this layer (0: nothing to copy)

    def write_blocks(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks `ids` (long, on the device) ← `src` (uint8 [len(ids), block_bytes], on the device or host)."""
        ...


@dataclass(slots=True)
class SwapItem:
    staging: np.ndarray   # uint8 [n, block_bytes], host (the fetcher's shared memory)
    block_ids: list[int]  # device blocks receiving them, in order


class SwapIn:
    """`items` are staged already; `fetch`, when given, runs first in the copier thread and returns
    more (what it read intact). `fetched` is set once fetch has returned (or failed)."""

    def __init__(self, caches: Sequence[BlockSink], items: list[SwapItem], device: torch.device, *,
                 fetch: Callable[[], list[SwapItem]] | None = None) -> None:
        self.caches, self.device, self.fetch = caches, device, fetch
        sizes = [c.block_bytes for c in caches]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.items = items
        self.ready = [threading.Event() for _ in caches]
        self.fetched = threading.Event()
        self.cuda_events = [torch.cuda.Event() for _ in caches] if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_s = 0.0
        self.wait_s = 0.0
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # held while a layer copies; `cancel` takes it to stop the copier
        self._cancelled = False
        self.thread = threading.Thread(target=self._run, name="kvledger-swapin", daemon=True)

    def start(self) -> SwapIn:
        self.thread.start()
        return self

    def _staged(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        items = list(self.items)
        try:
            if self.fetch is not None:
                items += self.fetch()
        finally:
            self.fetched.set()
        return [(torch.from_numpy(it.staging), torch.tensor(it.block_ids, dtype=torch.long, device=self.device))
                for it in items if it.block_ids]

    def _copy_layer(self, layer: int, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cache = self.caches[layer]
        if cache.block_bytes == 0:
            return
        off, size = self.offsets[layer], cache.block_bytes
        for staging, ids in staged:
            src = staging[:len(ids), off:off + size]
            if self.device.type != "cpu":
                src = src.contiguous().to(self.device, non_blocking=False)
            cache.write_blocks(ids, src)

    def _run(self) -> None:
        try:
            staged = self._staged()
            t0 = time.perf_counter()
            for layer in range(len(self.caches)):
                with self._lock:
                    if self._cancelled:
                        break
                    if self.stream is not None:
                        with torch.cuda.stream(self.stream):
                            self._copy_layer(layer, staged)
                            self.cuda_events[layer].record(self.stream)
                    else:
                        self._copy_layer(layer, staged)
                self.ready[layer].set()
            self.copy_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - surfaced in before_layer, never swallowed
            self.error = e
        finally:
            self.fetched.set()
            for ev in self.ready:
                ev.set()

    def before_layer(self, layer: int, limit_s: float = WAIT_LIMIT_S) -> None:
        """Block until layer `layer`'s hit blocks are on the device."""
        t0 = time.perf_counter()
        if not self.ready[layer].wait(limit_s):
            raise RuntimeError(f"swap-in of layer {layer} did not finish in {limit_s} s")
        if self.error is not None:
            raise RuntimeError("swap-in failed") from self.error
        if self._cancelled:
            raise RuntimeError("swap-in was cancelled")
        if self.cuda_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self.cuda_events[layer])
        self.wait_s += time.perf_counter() - t0

    def cancel(self) -> None:
        """Stop the copier: once this returns, no layer copy is running or will start."""
        with self._lock:
            self._cancelled = True

    def finish(self, limit_s: float = WAIT_LIMIT_S) -> None:
        self.thread.join(limit_s)
        assert not self.thread.is_alive(), "swap-in thread outlived its forward"
