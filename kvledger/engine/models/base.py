"""The model interface the engine drives: per-layer caches keyed by `LayerKind`, and a forward.

A model (Llama, tiny-v4, ...) is a `Model` whose `caches[l]` is a `LayerCache` for layer l of
`spec.layers`. The engine never looks inside a cache beyond this interface:

  block-ledger bytes   `LayerCache.block_bytes` bytes per block for layer l (0: the layer keeps no
                       history, e.g. a sliding-window-only layer). One block on the block ledger is
                       the concatenation, in layer order, of every layer's `block_view(b)` bytes:

                           | layer 0 bytes | layer 1 bytes | ... | layer n-1 bytes |   = spec.block_bytes()

                       so swap-in copies layer l of all hit blocks while layer l-1 computes.
  device blocks        `allocate(num_blocks, num_slots, device)` makes room for `num_blocks`
                       blocks of `spec.block_size` tokens (block id 0 is the engine's null block,
                       never read) and `num_slots` state slots (window rings, SWA models only).
  snapshots (rule 4)   `export_window(slot, position, out)` writes the sliding window that ends at
                       `position` (tokens [position - R, position), R = spec.inference_ring(),
                       zeros before 0) of the layers a snapshot keeps (the first
                       `spec.swa_stored_layers` windowed layers, in layer order) into `out`
                       (`spec.state_size_to_disk()` bytes); `import_window` is its inverse. After a
                       prefill the engine exports at each `core.prefill_store_positions` position, so a
                       model keeps `spec.kvstore_ring()` tokens of window per slot while prefilling.

The forward runs `Chunk`s (one per sequence in the batch). The ranges of one chunk:

    | positions                        | block KV (history)            | window KV (state)          |
    |----------------------------------|-------------------------------|----------------------------|
    | [0, start)                       | in the caches: read only      | in the slot's ring         |
    | [start, keep_blocks_until)       | in the caches: read, NEVER    | computed and written       |
    |   (bounded replay, rule 3)       |   written (reused as is)      |   (window truncated at s)  |
    | [max(start, keep_blocks_until),  | computed and written          | computed and written       |
    |   end)                           |                               |                            |

`truncate_from` = s: a sliding-window query at i attends keys max(s, i − W + 1)..i (`window_start`).
Full-attention models (Llama) have no window: `keep_blocks_until` is 0 and `truncate_from` None.

Before layer l reads its caches the forward calls `before_layer(l)` (when given): swap-in blocks
there until layer l's hit blocks are on the device. A model is served through its entry in `registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvledger.core import LayerKind, ModelSpec
from kvledger.engine.models.decode_mirror import DecodeMirror
from kvledger.engine.rows import index_copy_rows

NULL_BLOCK = 0  # device block 0 is never assigned to a sequence: padding in block tables points at it

BeforeLayer = Callable[[int], None]


def window_start(query_pos: int, window: int, truncate_from: int | None) -> int:
    """First key a sliding-window query at `query_pos` attends: max(s, i − W + 1), s = truncate_from or 0.

    Worked example (W = 128): i = 300, no truncation → keys 173..300; the fallback block of a hit at
    L1 = 384 runs i in [256, 384) with s = 256 → i = 300 attends 256..300, i = 383 attends 256..383."""
    return max(truncate_from or 0, query_pos - window + 1)


@dataclass(slots=True)
class Chunk:
    """One sequence's slice [start, end) of a forward pass; ranges in the module docstring."""

    tokens: torch.Tensor         # int64 [end - start], on the model's device
    start: int                   # first position computed; KV of [0, start) is in the caches
    block_table: torch.Tensor    # int64 [>= ceil(end / B)] device block ids of the sequence, in order
    slot: int = -1               # state slot (window ring) of the sequence; -1 for models without SWA
    keep_blocks_until: int = 0   # block KV of positions < this is reused, never written (replay)
    truncate_from: int | None = None
    prompt_len: int = 0          # L, the request's own prompt length, also in a later leg whose tokens go past it
                                 # (tiny-v4: YoCo anchor L − 134; rule 10); 0: not given
    seq: int = -1                # the sequence's process-unique id (`Sequence.uid`; decode_mirror); -1: none

    def __post_init__(self) -> None:
        assert self.tokens.dim() == 1 and self.tokens.numel() > 0, "a chunk computes at least one token"
        assert self.start >= 0 and (self.truncate_from is None or self.truncate_from <= self.start)

    @property
    def end(self) -> int:
        return self.start + self.tokens.numel()


class LayerCache(ABC):
    """The device KV of one layer, of one `LayerKind` (STYLE item 4: one manager per layer kind).

    Invariant: `block_view(b)` is a uint8 view of exactly `block_bytes` bytes of device memory
    holding everything the block ledger keeps of block b for this layer; writing it and then
    computing gives the same result as having computed that block."""

    kind: LayerKind
    block_bytes: int   # block-ledger bytes of one block for this layer (0: no history)
    window_bytes: int  # bytes of this layer's window in a snapshot (0: not stored in a snapshot)

    @abstractmethod
    def allocate(self, num_blocks: int, num_slots: int, device: torch.device,
                 storage: torch.Tensor | None = None) -> None:
        """Make room for `num_blocks` blocks and `num_slots` windows. `storage`, when given, is where the blocks live:
        uint8 [num_blocks, block_bytes] of zeros on `device` (`Model.allocate`'s shared area); else the cache
        allocates its own."""

    def blocks_u8(self) -> torch.Tensor:
        """uint8 [num_blocks, block_bytes] view of this layer's block storage (swap-in, store)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no block KV")

    def block_view(self, block: int) -> torch.Tensor:
        return self.blocks_u8()[block]

    def write_blocks(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks `ids` ← `src` (uint8 [len(ids), block_bytes]): the swap-in's copy (swapin.BlockSink)."""
        index_copy_rows(self.blocks_u8(), ids, src)

    def export_window(self, slot: int, position: int, out: torch.Tensor) -> None:
        """Window ending at `position` into `out` (uint8 [window_bytes], host)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no window")

    def import_window(self, slot: int, position: int, src: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no window")


class PagedKV(LayerCache):
    """Full-attention K and V in blocks of B tokens: [num_blocks, 2 (K, V), B, kv_heads, head_dim].

    Block bytes: 2 × B × kv_heads × head_dim × itemsize (Llama bf16: 2·128·3·64·2 = 98,304 per layer).
    `mirror_share`: the decode mirror's budget (`decode_heads`), as a share of the layer's pool bytes (0: none)."""

    kind = LayerKind.FULL
    window_bytes = 0

    def __init__(self, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 mirror_share: float = 0.0) -> None:
        assert mirror_share >= 0, mirror_share
        self.block_size, self.kv_heads, self.head_dim, self.dtype = block_size, kv_heads, head_dim, dtype
        self.block_bytes = 2 * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self.mirror_share = mirror_share
        self.mirror = DecodeMirror(0)
        self.kv: torch.Tensor | None = None

    def allocate(self, num_blocks: int, num_slots: int, device: torch.device,
                 storage: torch.Tensor | None = None) -> None:
        shape = (num_blocks, 2, self.block_size, self.kv_heads, self.head_dim)
        if storage is None:
            self.kv = torch.zeros(shape, dtype=self.dtype, device=device)
        else:
            self.kv = storage.view(self.dtype).view(shape)
        self.mirror = DecodeMirror(int(num_blocks * self.block_bytes * self.mirror_share))

    def blocks_u8(self) -> torch.Tensor:
        assert self.kv is not None, "allocate() first"
        return self.kv.view(self.kv.shape[0], -1).view(torch.uint8)

    def write(self, block_table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K, V ([n, kv_heads, head_dim]) of positions [start, start + n) into their blocks."""
        assert self.kv is not None
        if k.shape[0] == 1:   # a decode step: one slot, written through views (no index tensors)
            block = int(block_table[start // self.block_size])
            assert block != NULL_BLOCK, "a write through the null block: block table too short"
            self.kv[block, :, start % self.block_size].copy_(torch.stack((k[0], v[0])))
            return
        n, size = k.shape[0], self.block_size
        blocks = block_table[start // size:(start + n - 1) // size + 1].tolist()
        assert len(blocks) == (start + n - 1) // size - start // size + 1 and NULL_BLOCK not in blocks, \
            "a write through the null block: block table too short"
        done = 0
        for block in blocks:   # block by block through views: no index tensors, one converting copy each
            off = (start + done) % size
            m = min(size - off, n - done)
            self.kv[block, 0, off:off + m].copy_(k[done:done + m])
            self.kv[block, 1, off:off + m].copy_(v[done:done + m])
            done += m

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [0, length) as [length, kv_heads, head_dim] in `dtype`."""
        assert self.kv is not None
        n = -(-length // self.block_size)
        kv = self.kv[block_table[:n]]  # [n, 2, B, h, d]
        k = kv[:, 0].reshape(-1, self.kv_heads, self.head_dim)[:length]
        v = kv[:, 1].reshape(-1, self.kv_heads, self.head_dim)[:length]
        return k.to(dtype), v.to(dtype)

    def gather_heads(self, block_table: torch.Tensor, length: int, dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [0, length) as [kv_heads, length, head_dim] in `dtype`, the layout attention reads:
        the same values as `gather`, in two passes over the bytes (the gather of the blocks, then one copy that
        converts and puts heads first) where `gather` and a transpose take five. `out`: a [2, kv_heads, >= the
        blocks' positions, head_dim] buffer of `dtype` to write them into (K, V are then views of it)."""
        assert self.kv is not None
        n = -(-length // self.block_size)
        kv = self.kv[block_table[:n]]   # [n, 2, B, h, d]
        if out is None:
            out = torch.empty(2, self.kv_heads, n * self.block_size, self.head_dim, dtype=dtype, device=kv.device)
        assert out.dtype == dtype and out.shape[2] >= n * self.block_size, (out.dtype, out.shape)
        dst = out[:, :, :n * self.block_size]
        dst.view(2, self.kv_heads, n, self.block_size, self.head_dim).copy_(kv.permute(1, 3, 0, 2, 4))
        return dst[0, :, :length], dst[1, :, :length]

    def decode_heads(self, seq: int, block_table: torch.Tensor, start: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather_heads(block_table, start + 1, dtype)` for sequence `seq`'s one query at `start` (its KV
        written): read from the sequence's decode mirror when it holds [0, start) (decode_mirror.py)."""
        assert self.kv is not None, "allocate() first"
        return self.mirror.read(self, seq, block_table, start, dtype)


class Model(nn.Module, ABC):
    """What the engine drives. Subclasses set `spec`, `caches` (one per layer), `vocab_size`,
    `eos_token_ids`, `max_model_len`, and implement `forward`."""

    spec: ModelSpec
    caches: list[LayerCache]
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    @abstractmethod
    def forward(self, chunks: Sequence[Chunk], before_layer: BeforeLayer | None = None) -> torch.Tensor:
        """Run every chunk through every layer; float32 logits [len(chunks), vocab] of each chunk's
        last position. Writes the chunks' KV into the caches (per the ranges above)."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def allocate(self, num_blocks: int, num_slots: int, area: memoryview | None = None) -> None:
        """Every layer's caches. With `area` (a writable host buffer of at least `num_blocks · spec.block_bytes()`
        zeros: the engine's `SharedArea`, on the CPU), the blocks of every layer that keeps block KV live in it as
        `block_parts` lays them out, so a process mapping the same area can read ledger blocks straight into them."""
        parts = iter(self.block_parts(num_blocks))
        for cache in self.caches:
            storage = None
            if area is not None and cache.block_bytes:
                assert self.device.type == "cpu", "a shared area holds host blocks only"
                base, size = next(parts)
                storage = torch.frombuffer(area, dtype=torch.uint8, count=num_blocks * size, offset=base)
                storage = storage.view(num_blocks, size)
            cache.allocate(num_blocks, num_slots, self.device, storage)
            if storage is not None:
                assert cache.blocks_u8().data_ptr() == storage.data_ptr(), "a cache did not take its storage"

    def block_parts(self, num_blocks: int) -> list[tuple[int, int]]:
        """Where `allocate(num_blocks, ·, area)` puts the blocks of each layer that keeps block KV, in layer order (the
        order of their bytes in a ledger block): (base, block_bytes). Block b of that layer is bytes
        [base + b · block_bytes, base + (b + 1) · block_bytes): layer after layer, each [num_blocks, bytes]."""
        out, base = [], 0
        for size in self.layer_block_bytes():
            if size:
                out.append((base, size))
                base += num_blocks * size
        return out

    def layer_block_bytes(self) -> tuple[int, ...]:
        """Per layer, its bytes in one block-ledger block; the sum is `spec.block_bytes()`."""
        sizes = tuple(c.block_bytes for c in self.caches)
        assert sum(sizes) == self.spec.block_bytes(), f"{self.spec.name}: layer block bytes disagree with the spec"
        return sizes

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` ← block `src` in every layer that keeps block KV: the copy on write of a block shared
        through the device prefix cache, before a request rewrites a slot of it."""
        assert src != dst
        for cache in self.caches:
            if cache.block_bytes:
                u8 = cache.blocks_u8()
                u8[dst].copy_(u8[src])

    def import_block(self, block: int, data: torch.Tensor) -> None:
        """Block `block` ← `data` (uint8 [spec.block_bytes()], each layer's block bytes in layer order, as
        `LedgerWriter.export_blocks` lays a block out): a prompt's tail handed over by another engine (P/D)."""
        assert data.dtype == torch.uint8 and data.numel() == self.spec.block_bytes()
        ids = torch.tensor([block], dtype=torch.long, device=self.device)
        off = 0
        for cache in self.caches:
            if cache.block_bytes:
                cache.write_blocks(ids, data[off:off + cache.block_bytes].view(1, -1).to(self.device))
                off += cache.block_bytes

    def snapshot_layers(self) -> list[int]:
        """Layers whose window a snapshot keeps, in order (their window_bytes sum to the snapshot size)."""
        layers = [i for i, c in enumerate(self.caches) if c.window_bytes > 0]
        assert sum(self.caches[i].window_bytes for i in layers) == self.spec.state_size_to_disk()
        return layers

    def export_window(self, slot: int, position: int, out: torch.Tensor) -> None:
        """The snapshot at `position` (rule 4) into `out`: uint8 [spec.state_size_to_disk()], host."""
        off = 0
        for i in self.snapshot_layers():
            n = self.caches[i].window_bytes
            self.caches[i].export_window(slot, position, out[off:off + n])
            off += n

    def import_window(self, slot: int, position: int, src: torch.Tensor) -> None:
        off = 0
        for i in self.snapshot_layers():
            n = self.caches[i].window_bytes
            self.caches[i].import_window(slot, position, src[off:off + n])
            off += n
