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


def layer_index(name: str) -> tuple[int, str]:
    """Model order of a layer name ("model.layers.12.self_attn.attn" → 12), then the name."""
    found = re.findall(r"\d+", name)
    return (int(found[0]) if found else -1, name)


class KvLayout:
    """The registered KV caches of one worker, and the copies between them and block rows.

    Invariant: every layer's tensor holds `num_blocks` blocks of `layer_bytes` bytes each.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, layer_bytes: int) -> None:
        self.names = sorted(kv_caches, key=layer_index)
        self.layer_bytes = layer_bytes
        self.caches: dict[str, torch.Tensor] = {}
        for name in self.names:
            t = kv_caches[name]
            assert num_blocks in t.shape, f"{name}: no dimension of {num_blocks} blocks in {tuple(t.shape)}"
            per_block = t.numel() // num_blocks * t.element_size()
            if per_block != layer_bytes:
                raise ValueError(f"{name}: {per_block} bytes per block, expected {layer_bytes} "
                                 f"(shape {tuple(t.shape)}, {t.dtype})")
            self.caches[name] = t.movedim(t.shape.index(num_blocks), 0)  # a view: blocks first
        self.offsets = {name: i * layer_bytes for i, name in enumerate(self.names)}

    @property
    def block_bytes(self) -> int:
        return len(self.names) * self.layer_bytes

    def new_rows(self, n: int) -> torch.Tensor:
        """Host rows for `n` whole blocks (uint8, one row per block)."""
        return torch.empty((n, self.block_bytes), dtype=torch.uint8)

    def gather(self, name: str, block_ids: tuple[int, ...], rows: torch.Tensor) -> None:
        """Copy layer `name` of vLLM blocks `block_ids` into its column span of `rows`."""
        cache = self.caches[name]
        ids = torch.tensor(block_ids, dtype=torch.long)
        raw = cache.index_select(0, ids).contiguous().view(torch.uint8).reshape(len(block_ids), -1)
        off = self.offsets[name]
        rows[:len(block_ids), off:off + self.layer_bytes].copy_(raw)

    def scatter(self, name: str, rows: torch.Tensor, block_ids: tuple[int, ...]) -> None:
        """Copy layer `name`'s column span of `rows` into vLLM blocks `block_ids`."""
        if not block_ids:
            return
        cache = self.caches[name]
        off = self.offsets[name]
        n = len(block_ids)
        src = rows[:n, off:off + self.layer_bytes].contiguous().view(cache.dtype).reshape(n, *cache.shape[1:])
        cache.index_copy_(0, torch.tensor(block_ids, dtype=torch.long), src)
