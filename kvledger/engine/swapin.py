"""Layer-wise swap-in (rule 6): hit blocks go from host staging to the device caches layer by layer,
while earlier layers compute.

A copier thread copies layer 0 of every hit block, signals layer 0, copies layer 1, ... The forward
calls `before_layer(l)` before layer l reads its caches and blocks only if layer l is not copied
yet; the time it blocks is the swap-in the compute did not hide. On CUDA the copies run on a side
stream and layer l's compute waits on that stream's event (the host thread only issues them).

Layer l of block i sits at bytes [offset_l, offset_l + size_l) of the block (models/base.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvledger.engine.models.base import LayerCache

WAIT_LIMIT_S = 60.0


@dataclass(slots=True)
class SwapItem:
    staging: np.ndarray   # uint8 [n, block_bytes], host (the fetcher's shared memory)
    block_ids: list[int]  # device blocks receiving them, in order


class SwapIn:
    def __init__(self, caches: list[LayerCache], items: list[SwapItem], device: torch.device) -> None:
        self.caches, self.device = caches, device
        sizes = [c.block_bytes for c in caches]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.items = [(torch.from_numpy(it.staging), torch.tensor(it.block_ids, dtype=torch.long, device=device))
                      for it in items if it.block_ids]
        self.ready = [threading.Event() for _ in caches]
        self.cuda_events = [torch.cuda.Event() for _ in caches] if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_s = 0.0
        self.wait_s = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvledger-swapin", daemon=True)

    def start(self) -> SwapIn:
        self.thread.start()
        return self

    def _copy_layer(self, layer: int) -> None:
        cache = self.caches[layer]
        if cache.block_bytes == 0:
            return
        off, size = self.offsets[layer], cache.block_bytes
        dst = cache.blocks_u8()
        for staging, ids in self.items:
            src = staging[:, off:off + size]
            if self.device.type != "cpu":
                src = src.contiguous().to(self.device, non_blocking=False)
            dst.index_copy_(0, ids, src)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for layer in range(len(self.caches)):
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self._copy_layer(layer)
                        self.cuda_events[layer].record(self.stream)
                else:
                    self._copy_layer(layer)
                self.ready[layer].set()
        except BaseException as e:  # noqa: BLE001 - surfaced in before_layer, never swallowed
            self.error = e
            for ev in self.ready:
                ev.set()
        self.copy_s = time.perf_counter() - t0

    def before_layer(self, layer: int) -> None:
        """Block until layer `layer`'s hit blocks are on the device."""
        t0 = time.perf_counter()
        if not self.ready[layer].wait(WAIT_LIMIT_S):
            raise RuntimeError(f"swap-in of layer {layer} did not finish in {WAIT_LIMIT_S} s")
        if self.error is not None:
            raise RuntimeError("swap-in failed") from self.error
        if self.cuda_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self.cuda_events[layer])
        self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        self.thread.join(WAIT_LIMIT_S)
        assert not self.thread.is_alive(), "swap-in thread outlived its forward"
