"""Sliding-window K and V in a ring per state slot: the device cache of a `LayerKind.SWA` layer (Gemma 3).

A layer whose attention only looks back W tokens keeps no history (0 block bytes): its K and V live in
one ring per state slot, [num_slots, ring_len, 2 (K, V), kv_heads, head_dim] in bf16, position p at row
p mod ring_len, ring_len = `spec.kvstore_ring()` (Gemma 3: 518 + 128 = 646), so that after a prefill of
L tokens the window of every rule-4 store position (≥ L − 128) is still held.

    ring rows of a slot     what they hold
    [valid_from, end)       K, V this sequence computed or imported (end: last position written + 1)
    [end − ring_len, valid_from)  stale (another sequence's, or nothing): never read

`valid_from` is 0 after a chunk that starts at 0, s after a chunk truncated at s (a replay), and
max(P − R, 0) after `import_window(slot, P)`, R = `spec.inference_ring()` (W + K = 518).

A snapshot's bytes for this layer (`window_bytes` = R × 2 × kv_heads × head_dim × 2 B; Gemma 3: 518 ×
1,024 B) are positions [P − R, P), token-major, each token K then V:

    | token P − R: K (kv_heads × head_dim bf16) | V | token P − R + 1: K | V | ... | token P − 1: K | V |

zeros for positions before 0 or before a truncation (never attended: rule 9 stores no truncated window).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvledger.core.spec import LayerKind, ModelSpec
from kvledger.engine.models.base import LayerCache


class RingKV(LayerCache):
    """One sliding-window layer's rings (module docstring)."""

    kind = LayerKind.SWA
    block_bytes = 0

    def __init__(self, spec: ModelSpec, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> None:
        assert spec.window is not None, "a ring needs a sliding window"
        self.window, self.ring_len, self.snapshot_len = spec.window, spec.kvstore_ring(), spec.inference_ring()
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        token_bytes = 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        assert token_bytes == spec.swa_bytes_per_token, f"{spec.name}: {token_bytes} B per token, the spec says " \
                                                        f"{spec.swa_bytes_per_token}"
        self.window_bytes = self.snapshot_len * token_bytes
        self.kv: Tensor | None = None
        self.valid_from: list[int] = []
        self.end: list[int] = []

    def allocate(self, num_blocks: int, num_slots: int, device: torch.device,
                 storage: torch.Tensor | None = None) -> None:
        assert storage is None, "a ring keeps no blocks"
        shape = (num_slots, self.ring_len, 2, self.kv_heads, self.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=device)
        self.valid_from, self.end = [0] * num_slots, [0] * num_slots

    def reset(self, slot: int, valid_from: int) -> None:
        """A sequence (re)starts its window at `valid_from` in this slot: older rows are stale."""
        self.valid_from[slot] = self.end[slot] = valid_from

    def read(self, slot: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """K, V of positions [lo, hi), each [hi − lo, kv_heads, head_dim] in the ring's dtype; they must be held."""
        assert self.kv is not None, "allocate() first"
        assert self.valid_from[slot] <= lo <= hi <= self.end[slot] and self.end[slot] - self.ring_len <= lo, (
            f"slot {slot}: holds [{max(self.valid_from[slot], self.end[slot] - self.ring_len)}, {self.end[slot]}), "
            f"asked [{lo}, {hi})")
        rows = self.kv[slot, torch.arange(lo, hi, device=self.kv.device) % self.ring_len]
        return rows[:, 0], rows[:, 1]

    def write(self, slot: int, first: int, k: Tensor, v: Tensor) -> None:
        """K, V ([n, kv_heads, head_dim]) of positions [first, first + n); only the newest ring_len are kept."""
        assert self.kv is not None, "allocate() first"
        assert first == self.end[slot], f"slot {slot}: rows at {first}, the ring ends at {self.end[slot]}"
        hi = first + k.shape[0]
        lo = max(first, hi - self.ring_len)
        rows = torch.arange(lo, hi, device=self.kv.device) % self.ring_len
        self.kv[slot, rows, 0] = k[lo - first:].to(self.dtype)
        self.kv[slot, rows, 1] = v[lo - first:].to(self.dtype)
        self.end[slot] = hi

    def export_window(self, slot: int, position: int, out: Tensor) -> None:
        """Positions [position − R, position) as bytes into `out` (layout in the module docstring)."""
        lo = max(position - self.snapshot_len, 0, self.valid_from[slot])
        assert lo <= position - (self.window - 1) or lo == 0, (
            f"slot {slot}: the window at {position} starts at {lo}: not restorable")
        rows = torch.zeros(self.snapshot_len, 2, self.kv_heads, self.head_dim, dtype=self.dtype)
        k, v = self.read(slot, lo, position)
        rows[self.snapshot_len - (position - lo):, 0] = k.cpu()
        rows[self.snapshot_len - (position - lo):, 1] = v.cpu()
        out.copy_(rows.view(-1).view(torch.uint8))

    def import_window(self, slot: int, position: int, src: Tensor) -> None:
        """Restore the window at `position` (`export_window`'s inverse): the ring then holds [max(position − R, 0),
        position) and the sequence resumes at `position`."""
        assert self.kv is not None, "allocate() first"
        shape = (self.snapshot_len, 2, self.kv_heads, self.head_dim)
        rows = src.to(self.kv.device).contiguous().view(self.dtype).view(shape)
        lo = max(position - self.snapshot_len, 0)
        self.reset(slot, lo)
        held = rows[self.snapshot_len - (position - lo):]
        self.write(slot, lo, held[:, 0], held[:, 1])
