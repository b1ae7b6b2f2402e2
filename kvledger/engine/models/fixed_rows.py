"""Products whose floats never depend on how positions were split into chunks, batches or steps.

A GEMM's rounding depends on the kernel the BLAS picks, and MKL picks it by CPU and by the row count
(a 1-row decode step and a 300-row prefill round differently in the last bits). A resumed prefill, a
chunked one and a cold one then compute the same position with different floats; where K and V are
kept in bf16, a last-bit difference sometimes rounds a value to the other bf16 neighbour, and a near-tie
between two tokens can flip many tokens later. So every product of a model that claims bit-exact
resumes has a row count fixed by absolute positions, never by the split:

    product                    GEMM rows     row of position p at
    `mm` (projections, MLP)    ROW_TILE      slot p % ROW_TILE of its ROW_TILE-row GEMM (others zeros)
    `mm_rows` (logits head)    1             a GEMM of its own
    attention (per model)      its tile      slot p % tile of its query tile, keys fixed by the tile

Whatever kernel a machine picks for those shapes it picks for every split alike, so a row's floats
depend only on its own inputs. Elementwise ops, norms and softmax are per row already. Exact against
the same machine's cold prefill; across CPUs (AVX2, AVX-512, AMX) the floats differ in the last bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROW_TILE = 16


def place_rows(x: Tensor, dim: int, offset: int, size: int) -> Tensor:
    """A zero tensor of `size` along `dim` with x at [offset, offset + x.shape[dim]) (x itself when it fits
    exactly)."""
    n = x.shape[dim]
    assert offset >= 0 and offset + n <= size, f"rows [{offset}, {offset + n}) do not fit in {size}"
    if offset == 0 and n == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, offset, n).copy_(x)
    return out


def mm_rows(x: Tensor, w: Tensor) -> Tensor:
    """x @ w one row at a time: 1-row GEMMs, the same shape for every row of every split. For a product the
    engine takes of one row per sequence, the logits head: with 32,000 columns a 16-row GEMM costs 7× a 1-row
    one (8.4 against 1.1 ms on the 2-core CPU)."""
    out = x.new_empty(x.shape[0], w.shape[1])
    for i in range(x.shape[0]):
        torch.mm(x[i:i + 1], w, out=out[i:i + 1])
    return out


def mm(x: Tensor, w: Tensor, first: int) -> Tensor:
    """x @ w for the rows of positions [first, first + len(x)): GEMMs of exactly ROW_TILE rows, the row of
    position p at slot p % ROW_TILE (module docstring), so its floats never depend on the split."""
    lead, n = first % ROW_TILE, x.shape[0]
    rows = place_rows(x, 0, lead, -(-(lead + n) // ROW_TILE) * ROW_TILE)
    out = x.new_empty(rows.shape[0], w.shape[1])
    for t in range(0, rows.shape[0], ROW_TILE):
        torch.mm(rows[t:t + ROW_TILE], w, out=out[t:t + ROW_TILE])
    return out[lead:lead + n]
