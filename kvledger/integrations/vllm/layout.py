"""Where one ledger block's bytes live in vLLM's paged KV cache, layer by layer.

A ledger block is one vLLM block of 128 tokens, all layers, stored whole:

    offset 0                    layer_bytes              2·layer_bytes  …  n_layers·layer_bytes
    | layer 0's slice of block b | layer 1's slice of b | …             |

where a layer's slice is that layer's KV-cache tensor indexed at block b along its block
dimension, in vLLM's own byte order for the platform (CPU: [kv_heads, 128, 2·head_dim]),
and layers are in model order. `layer_bytes` = 128 × 2 × kv_heads × head_dim × dtype size.

torch only (no vLLM import): the main suite tests it on plain tensors.
"""

from __future__ import annotations

import re

import torch

from kvledger.engine.rows import index_copy_rows, index_select_rows


def layer_index(name: str) -> tuple[int, str]:
    """Model order of a layer name ("model.layers.12.self_attn.attn" → 12), then the name."""
    found = re.findall(r"\d+", name)
    return (int(found[0]) if found else -1, name)


class VllmLayer:
    """One layer's registered KV tensor, blocks first (a view); the swap-in's `BlockSink`.

    `blocks` is uint8 [num_blocks, block_bytes] over the same memory when each block's slice is
    contiguous (vLLM's CPU layout): a block then moves as one flat copy, no staging copy between.
    """

    def __init__(self, name: str, tensor: torch.Tensor, num_blocks: int, block_bytes: int) -> None:
        assert num_blocks in tensor.shape, f"{name}: no dimension of {num_blocks} blocks in {tuple(tensor.shape)}"
        per_block = tensor.numel() // num_blocks * tensor.element_size()
        if per_block != block_bytes:
            raise ValueError(f"{name}: {per_block} bytes per block, expected {block_bytes} "
                             f"(shape {tuple(tensor.shape)}, {tensor.dtype})")
        self.name = name
        self.block_bytes = block_bytes
        self.cache = tensor.movedim(tensor.shape.index(num_blocks), 0)
        flat = self.cache.is_contiguous()
        self.blocks = self.cache.view(num_blocks, -1).view(torch.uint8) if flat else None

    def write_blocks(self, ids: torch.Tensor, src: torch.Tensor) -> None:
        """Blocks `ids` ← `src` (uint8 [len(ids), block_bytes], rows may be strided)."""
        if self.blocks is not None:
            index_copy_rows(self.blocks, ids, src)
            return
        n = len(ids)
        typed = src.contiguous().view(self.cache.dtype).reshape(n, *self.cache.shape[1:])
        self.cache.index_copy_(0, ids, typed)

    def read_blocks(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """`out` (uint8 [len(ids), block_bytes], rows may be strided) ← blocks `ids`."""
        if self.blocks is not None:
            index_select_rows(self.blocks, ids, out)
            return
        out.copy_(self.cache.index_select(0, ids).contiguous().view(torch.uint8).reshape(len(ids), -1))


class KvLayout:
    """The registered KV caches of one worker, in model order, and the host rows of whole blocks.

    Invariant: every layer's tensor holds `num_blocks` blocks of `layer_bytes` bytes each.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, layer_bytes: int) -> None:
        self.names = sorted(kv_caches, key=layer_index)
        self.layer_bytes = layer_bytes
        self.layers = [VllmLayer(name, kv_caches[name], num_blocks, layer_bytes) for name in self.names]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.offsets = {name: i * layer_bytes for i, name in enumerate(self.names)}

    @property
    def block_bytes(self) -> int:
        return len(self.names) * self.layer_bytes

    @property
    def device(self) -> torch.device:
        return self.layers[0].cache.device if self.layers else torch.device("cpu")

    def gather(self, name: str, block_ids: tuple[int, ...], rows: torch.Tensor) -> None:
        """Copy layer `name` of vLLM blocks `block_ids` into its column span of `rows`."""
        off = self.offsets[name]
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.layers[self.index[name]].read_blocks(ids, rows[:len(block_ids), off:off + self.layer_bytes])

    def scatter(self, name: str, rows: torch.Tensor, block_ids: tuple[int, ...]) -> None:
        """Copy layer `name`'s column span of `rows` into vLLM blocks `block_ids`."""
        if not block_ids:
            return
        off = self.offsets[name]
        ids = torch.tensor(block_ids, dtype=torch.long)
        self.layers[self.index[name]].write_blocks(ids, rows[:len(block_ids), off:off + self.layer_bytes])
