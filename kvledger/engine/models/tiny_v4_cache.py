"""tiny-v4's device KV for the engine: one `TinyV4LayerCache` per layer (`base.LayerCache`).

Every layer has a window ring per state slot: [num_slots, kvstore_ring (396), 64] fp16, position p
at row p mod 396. CSA and HCA layers also have blocks ([num_blocks, block_bytes] uint8, the layer's
slice of the block-ledger layout in `tiny_v4_state`) and, per slot, the compressor's open group
(fp32, never stored: empty at every block boundary).

    ring rows of a slot       what they hold
    [valid_from, end)         latents this sequence computed or imported (end: last position written + 1)
    [end − 396, valid_from)   stale (another sequence's, or nothing): never read

`valid_from` is 0 after a chunk that starts at 0, s after a chunk truncated at s, and P − 134 after
`import_window(slot, P)` (a snapshot). Consumer layers hold rows from the YoCo anchor on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvledger.core.spec import LayerKind, ModelSpec
from kvledger.engine.models.base import NULL_BLOCK, LayerCache
from kvledger.engine.models.tiny_v4_state import LayerSlice, Tail


class TinyV4LayerCache(LayerCache):
    """One layer's window rings, and for CSA/HCA its blocks and open groups."""

    def __init__(self, spec: ModelSpec, layer: int, part: LayerSlice | None, latent_dim: int, index_dim: int) -> None:
        self.kind, self.layer, self.part = spec.layers[layer], layer, part
        self.latent_dim, self.index_dim = latent_dim, index_dim
        self.ring_len, self.snapshot_len, self.window = spec.kvstore_ring(), spec.inference_ring(), spec.window
        self.block_bytes = part.end - part.offset if part else 0
        stored = layer < spec.swa_stored_layers
        self.window_bytes = self.snapshot_len * latent_dim * 2 if stored else 0
        self.ratio = {LayerKind.CSA: spec.csa_ratio, LayerKind.HCA: spec.hca_ratio}.get(self.kind)
        self.ring: Tensor | None = None
        self.blocks: Tensor | None = None
        self.valid_from: list[int] = []
        self.end: list[int] = []

    def allocate(self, num_blocks: int, num_slots: int, device: torch.device,
                 storage: torch.Tensor | None = None) -> None:
        self.ring = torch.zeros(num_slots, self.ring_len, self.latent_dim, dtype=torch.float16, device=device)
        self.valid_from, self.end = [0] * num_slots, [0] * num_slots
        if self.part is None:
            return
        self.blocks = storage if storage is not None else torch.zeros(num_blocks, self.block_bytes, dtype=torch.uint8,
                                                                       device=device)
        width = 2 * self.latent_dim + (2 * self.index_dim if self.kind is LayerKind.CSA else 0)
        self.tails = torch.zeros(num_slots, self.ratio, width, dtype=torch.float32, device=device)

    def blocks_u8(self) -> Tensor:
        assert self.blocks is not None, "allocate() first (and only CSA/HCA layers keep blocks)"
        return self.blocks

    # --- the window ring ---------------------------------------------------------------

    def reset(self, slot: int, valid_from: int) -> None:
        """A sequence (re)starts its window at `valid_from` in this slot: older rows are stale."""
        self.valid_from[slot] = self.end[slot] = valid_from

    def read_window(self, slot: int, lo: int, hi: int) -> Tensor:
        """Latents of positions [lo, hi) as float32; they must be held."""
        assert self.valid_from[slot] <= lo <= hi <= self.end[slot] and hi - lo <= self.ring_len, (
            f"layer {self.layer} slot {slot}: holds [{self.valid_from[slot]}, {self.end[slot]}), asked [{lo}, {hi})")
        rows = torch.arange(lo, hi, device=self.ring.device) % self.ring_len
        return self.ring[slot, rows].float()

    def write_window(self, slot: int, first: int, latents: Tensor) -> None:
        """Latents of positions [first, first + n); only the newest ring_len are kept."""
        assert first == self.end[slot], f"layer {self.layer} slot {slot}: rows at {first}, ring ends {self.end[slot]}"
        hi = first + latents.shape[0]
        lo = max(first, hi - self.ring_len)
        rows = torch.arange(lo, hi, device=self.ring.device) % self.ring_len
        self.ring[slot, rows] = latents[lo - first:].to(torch.float16)
        self.end[slot] = hi

    def export_window(self, slot: int, position: int, out: Tensor) -> None:
        """Positions [position − 134, position) as fp16 bytes into `out`.

        Slots before position 0, or before a truncation at s (fallback / replay), are zeros: only
        the last W − 1 = 127 are ever read back, and those are always held (every store position
        is >= s + 128)."""
        lo = max(position - self.snapshot_len, 0, self.valid_from[slot])
        assert lo <= position - (self.window - 1) or lo == 0, (
            f"layer {self.layer} slot {slot}: the window at {position} starts at {lo}: not restorable")
        assert self.end[slot] - self.ring_len <= lo and position <= self.end[slot], "window no longer in the ring"
        rows = torch.zeros(self.snapshot_len, self.latent_dim, dtype=torch.float16)
        rows[self.snapshot_len - (position - lo):] = self.read_window(slot, lo, position).to("cpu", torch.float16)
        out.copy_(rows.view(-1).view(torch.uint8))

    def import_window(self, slot: int, position: int, src: Tensor) -> None:
        """Restore the window at `position`; the zero slots of a truncated export are read as held but
        never attended (a query at >= position attends position − 127 on)."""
        rows = src.to(self.ring.device).contiguous().view(torch.float16).view(self.snapshot_len, self.latent_dim)
        lo = max(position - self.snapshot_len, 0)
        self.reset(slot, lo)
        self.write_window(slot, lo, rows[self.snapshot_len - (position - lo):].float())

    # --- blocks and the open group ------------------------------------------------------

    def _views(self) -> tuple[Tensor, Tensor | None]:
        n, main = self.part.entries, self.part.main_bytes
        entries = self.blocks[:, :main].view(torch.float16).view(-1, n, self.latent_dim)
        index = self.blocks[:, main:].view(torch.float16).view(-1, n, self.index_dim) if self.part.index_bytes else None
        return entries, index

    def read_entries(self, block_table: Tensor, count: int) -> tuple[Tensor, Tensor | None]:
        """The first `count` entries (and index keys) of a sequence, float32."""
        per_block = self.part.entries
        blocks = block_table[:-(-count // per_block)]
        assert bool((blocks != NULL_BLOCK).all()), f"layer {self.layer}: a read through the null block"
        entries, index = self._views()
        out = entries[blocks].reshape(-1, self.latent_dim)[:count].float()
        return out, (index[blocks].reshape(-1, self.index_dim)[:count].float() if index is not None else None)

    def write_entries(self, block_table: Tensor, first: int, entries: Tensor, index: Tensor | None) -> None:
        """Entries first, first + 1, ... into their blocks."""
        if entries.shape[0] == 0:
            return
        g = torch.arange(first, first + entries.shape[0], device=entries.device)
        blocks, offs = block_table[g // self.part.entries], g % self.part.entries
        assert bool((blocks != NULL_BLOCK).all()), f"layer {self.layer}: a write through the null block"
        views = self._views()
        views[0][blocks, offs] = entries.to(torch.float16)
        if index is not None:
            views[1][blocks, offs] = index.to(torch.float16)

    def read_tail(self, slot: int, count: int) -> Tail:
        rows = self.tails[slot, :count]
        lat = self.latent_dim
        if self.kind is LayerKind.CSA:
            idx = 2 * lat + self.index_dim
            return Tail(rows[:, :lat], rows[:, lat:2 * lat], rows[:, 2 * lat:idx], rows[:, idx:])
        return Tail(rows[:, :lat], rows[:, lat:])

    def write_tail(self, slot: int, tail: Tail) -> None:
        parts = [tail.kv, tail.gate] + ([tail.index_kv, tail.index_gate] if tail.index_kv is not None else [])
        self.tails[slot, :tail.n] = torch.cat(parts, dim=1)
