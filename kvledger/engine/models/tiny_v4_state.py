"""tiny-v4's per-sequence KV state, and its two byte layouts (block and snapshot).

One `SeqState` holds everything a sequence's next forward step reads:

  windows[l]     sliding-window latents of layer l for positions [start, end): state, never history.
                 Encoder layers (the first `spec.swa_stored_layers`) keep the prefill kvstore ring
                 (396 tokens) so that both rule-4 snapshots can be cut after prefill; consumer
                 layers (YoCo) start at the sequence's anchor and are never stored.
  entries[l]     compressed entries of a CSA/HCA layer, one per closed group of `ratio` tokens
                 (history: what the block ledger stores).
  index_keys[l]  the lightning indexer's key per CSA entry (history).
  tails[l]       the compressor's open group: the projected rows since the last closed group
                 (fp32, never stored; empty at every multiple of 128 = lcm(4, 128)).

Every latent, entry and index key is rounded to fp16 when it is produced, so the bytes the
ledgers hold are exactly the values a cold prefill computed with.

Block bytes (one 128-token block, `spec.block_bytes()` = 128 × (99 + 48) = 18,816 B), layer-major,
little-endian fp16, each layer's part contiguous so swap-in can go layer by layer:

    offset  layer  kind  contents
         0      2  CSA   32 entries × 64 fp16 (4,096 B), then 32 index keys × 32 fp16 (2,048 B)
     6,144      3  HCA    1 entry × 64 fp16 (128 B)
     6,272      4  CSA   4,096 + 2,048 B   (YoCo consumer: projected from the encoder's last hidden state)
    12,416      5  HCA   128 B             (consumer)
    12,544      6  CSA   4,096 + 2,048 B   (consumer)
    18,688      7  HCA   128 B             (consumer)
    18,816      end

Snapshot bytes at position P (`spec.state_size_to_disk()` = 4 × 134 × 128 = 68,608 B): the stored
(encoder) layers 0..3 in order, each 134 token slots × 64 fp16; slot j holds position P − 134 + j.
Slots before position 0 are zeros. On resume only the last W − 1 = 127 slots are read (a query at
P attends P − 127 .. P); the 6 slots before them are the backtrack slack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kvledger.core.spec import LayerKind, ModelSpec

FP16 = np.dtype("<f2")


def round16(x: Tensor) -> Tensor:
    """x rounded to fp16 and back: the exact values the ledgers will hold."""
    return x.to(torch.float16).to(x.dtype)


@dataclass(slots=True)
class Window:
    """Sliding-window latents of one layer for positions [start, start + len(latents))."""

    start: int
    latents: Tensor  # [n, latent_dim]

    @property
    def end(self) -> int:
        return self.start + self.latents.shape[0]

    def rows(self, lo: int, hi: int) -> Tensor:
        assert self.start <= lo <= hi <= self.end, f"window holds [{self.start}, {self.end}), asked [{lo}, {hi})"
        return self.latents[lo - self.start:hi - self.start]

    def append(self, first: int, rows: Tensor) -> None:
        assert first == self.end, f"window rows must be contiguous: end {self.end}, new rows at {first}"
        self.latents = torch.cat([self.latents, rows]) if self.latents.numel() else rows

    def trim(self, keep: int) -> None:
        """Keep only the newest `keep` positions (the ring)."""
        drop = self.latents.shape[0] - keep
        if drop > 0:
            self.latents = self.latents[drop:]
            self.start += drop


@dataclass(slots=True)
class Tail:
    """The compressor's open group: projected rows (kv, gate) since the last closed group."""

    kv: Tensor
    gate: Tensor
    index_kv: Tensor | None = None
    index_gate: Tensor | None = None

    @property
    def n(self) -> int:
        return self.kv.shape[0]


@dataclass(slots=True)
class SeqState:
    """One sequence's KV (see the module docstring).

    Invariants: every encoder window covers [max(floor, pos − W + 1), pos) or more; consumer
    windows start at `anchor`; entries[l] has ⌊pos / ratio⌋ rows and tails[l] pos mod ratio rows
    (a replayed sequence may hold more entries than that: they came from the block ledger).
    """

    pos: int                      # next position to compute
    anchor: int                   # YoCo: consumer layers compute positions >= anchor, windows floored there
    floor: int                    # encoder windows start no earlier than this (0, or s after a truncation)
    windows: list[Window]
    entries: list[Tensor | None]
    index_keys: list[Tensor | None]
    tails: list[Tail | None]
    exact: bool = True            # False once a window was truncated (fallback / replay): an approximation
    meta: dict = field(default_factory=dict)


def yoco_anchor(prompt_len: int, spec: ModelSpec) -> int:
    """Where the consumer layers start for a prompt of `prompt_len` tokens: L − yoco_keep, floored at 0.

    yoco_keep = W + K = 134 = R of rule 3, so every hit position P <= L − R is <= the anchor:
    the consumer layers never need anything before P and a resume is exact."""
    return max(prompt_len - spec.yoco_keep, 0)


def empty_state(spec: ModelSpec, latent_dim: int, index_dim: int, *, pos: int, anchor: int, floor: int,
                device: torch.device, dtype: torch.dtype) -> SeqState:
    """A state at `pos` with empty windows, no entries and empty tails (groups are closed at pos)."""
    assert pos % spec.block_size == 0, "a state starts at a block boundary"
    stored = spec.swa_stored_layers
    windows = [Window(floor if layer < stored else anchor, torch.zeros(0, latent_dim, device=device, dtype=dtype))
               for layer in range(spec.n_layers)]
    entries: list[Tensor | None] = []
    index_keys: list[Tensor | None] = []
    tails: list[Tail | None] = []
    for kind in spec.layers:
        comp = kind in (LayerKind.CSA, LayerKind.HCA)
        csa = kind is LayerKind.CSA
        entries.append(torch.zeros(0, latent_dim, device=device, dtype=dtype) if comp else None)
        index_keys.append(torch.zeros(0, index_dim, device=device, dtype=dtype) if csa else None)
        tails.append(_empty_tail(latent_dim, index_dim if csa else 0, device, dtype) if comp else None)
    return SeqState(pos, anchor, floor, windows, entries, index_keys, tails)


def _empty_tail(latent_dim: int, index_dim: int, device: torch.device, dtype: torch.dtype) -> Tail:
    z = torch.zeros(0, latent_dim, device=device, dtype=dtype)
    zi = torch.zeros(0, index_dim, device=device, dtype=dtype) if index_dim else None
    return Tail(z, z, zi, zi)


# --- byte layouts ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayerSlice:
    """One layer's part of a block: entries then index keys, at [offset, offset + main + index)."""

    layer: int
    kind: LayerKind
    offset: int
    entries: int       # entries of this layer per block (32 for CSA, 1 for HCA)
    main_bytes: int
    index_bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.main_bytes + self.index_bytes


def block_layout(spec: ModelSpec, latent_dim: int, index_dim: int) -> tuple[LayerSlice, ...]:
    """The per-layer slices of one block (see the module docstring); they tile `spec.block_bytes()`."""
    out, offset = [], 0
    for layer, kind in enumerate(spec.layers):
        if kind not in (LayerKind.CSA, LayerKind.HCA):
            continue
        ratio = spec.csa_ratio if kind is LayerKind.CSA else spec.hca_ratio
        n = spec.block_size // ratio
        index = n * index_dim * 2 if kind is LayerKind.CSA else 0
        out.append(LayerSlice(layer, kind, offset, n, n * latent_dim * 2, index))
        offset += n * latent_dim * 2 + index
    assert offset == spec.block_bytes(), f"layout {offset} B != spec.block_bytes() {spec.block_bytes()} B"
    return tuple(out)


def _to_bytes(x: Tensor) -> bytes:
    return x.detach().to("cpu", torch.float32).numpy().astype(FP16).tobytes()


def _from_bytes(data: bytes | memoryview, cols: int, like: Tensor) -> Tensor:
    arr = np.frombuffer(data, dtype=FP16).reshape(-1, cols).astype(np.float32)
    return torch.from_numpy(arr).to(like.device, like.dtype)


def block_bytes(state: SeqState, layout: tuple[LayerSlice, ...], block: int) -> bytes:
    """The ledger bytes of block `block` (tokens [128·block, 128·block + 128)); the block must be closed."""
    parts = []
    for part in layout:
        lo, hi = block * part.entries, (block + 1) * part.entries
        entries = state.entries[part.layer]
        assert entries is not None and entries.shape[0] >= hi, f"block {block} is not closed in layer {part.layer}"
        parts.append(_to_bytes(entries[lo:hi]))
        if part.index_bytes:
            parts.append(_to_bytes(state.index_keys[part.layer][lo:hi]))
    return b"".join(parts)


def load_block_layer(state: SeqState, part: LayerSlice, block: int, data: bytes | memoryview) -> None:
    """Append one layer's part of block `block` (its slice of the block bytes); blocks load in order."""
    assert len(data) == part.main_bytes + part.index_bytes, "wrong slice length"
    entries = state.entries[part.layer]
    assert entries is not None and entries.shape[0] == block * part.entries, (
        f"layer {part.layer}: block {block} loaded out of order ({entries.shape[0]} entries held)")
    view = memoryview(data)
    state.entries[part.layer] = torch.cat([entries, _from_bytes(view[:part.main_bytes], entries.shape[1], entries)])
    if part.index_bytes:
        keys = state.index_keys[part.layer]
        state.index_keys[part.layer] = torch.cat([keys, _from_bytes(view[part.main_bytes:], keys.shape[1], keys)])


def load_block(state: SeqState, layout: tuple[LayerSlice, ...], block: int, data: bytes | memoryview) -> None:
    """Append every layer's part of block `block`."""
    assert len(data) == layout[-1].end, f"block bytes: got {len(data)}, want {layout[-1].end}"
    view = memoryview(data)
    for part in layout:
        load_block_layer(state, part, block, view[part.offset:part.end])


def snapshot_bytes(state: SeqState, spec: ModelSpec, position: int) -> bytes:
    """The stored layers' windows at `position` (a multiple of B, <= pos): 134 slots per layer, zeros before 0."""
    ring = spec.inference_ring()
    assert position % spec.block_size == 0 and 0 < position <= state.pos
    parts = []
    for window in state.windows[:spec.swa_stored_layers]:
        lo = max(position - ring, 0)
        rows = window.rows(lo, position)
        pad = torch.zeros(ring - rows.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
        parts.append(_to_bytes(torch.cat([pad, rows])))
    data = b"".join(parts)
    assert len(data) == spec.state_size_to_disk()
    return data


def load_snapshot(state: SeqState, spec: ModelSpec, data: bytes | memoryview) -> None:
    """Restore the stored layers' windows at `state.pos` from snapshot bytes taken at that position."""
    assert len(data) == spec.state_size_to_disk(), f"snapshot bytes: got {len(data)}, want {spec.state_size_to_disk()}"
    ring, position = spec.inference_ring(), state.pos
    per_layer = len(data) // spec.swa_stored_layers
    view = memoryview(data)
    for layer in range(spec.swa_stored_layers):
        window = state.windows[layer]
        rows = _from_bytes(view[layer * per_layer:(layer + 1) * per_layer], window.latents.shape[1], window.latents)
        skip = max(ring - position, 0)  # slots before position 0
        state.windows[layer] = Window(position - ring + skip, rows[skip:])
