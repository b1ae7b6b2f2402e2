"""tiny-v4's attention over one layer's keys: a sliding window joined with compressed entries.

Keys of a query at position i (one softmax over both sets):

    window      latents at positions max(floor, i − W + 1) .. i        (W = 128)
    CSA         the top-k compressed entries g < ⌊(i + 1) / 4⌋ by the lightning indexer's score
    HCA         every compressed entry g < ⌊(i + 1) / 128⌋
    (entry g covers positions [g·ratio, (g + 1)·ratio) and is visible once its group is closed)

`floor` is 0 normally, s = L1 − 128 after a truncation (fallback / replay), and the YoCo anchor
for the consumer layers. Queries run in tiles of TILE = 32 aligned to absolute positions, each over the
W + 32 = 160 keys from W before the tile to its end, so no L × L mask is ever built.

Why a resume, a chunked prefill and a cold prefill compute the same floats on every CPU
(`fixed_rows`): no product here ever has a row count that depends on how the positions were split;
every row is computed at a place fixed by its absolute position p:

    product                      GEMM shape (rows)           row of position p at
    projections, MLP             ROW_TILE = 16               slot p % 16 of the 16-row GEMM
    logits head                  1                           a GEMM of its own (`mm_rows`)
    attention of one query tile  TILE = 32 query rows        slot p % 32 of its tile, over 160 keys
    (rows not held are zeros; their results are dropped)

Why 32: a decode step computes one query in a whole tile, so the tile sets what a decode step costs,
while each tile is a few Python calls, which a prefill makes per tile. Medians of 5 on the 2-core CPU, one
thread, a 639-token prompt, the head one row at a time (decode ms per token / prefill ms): tile 128: 46 /
195; 64: 37 / 191; 32: 32 / 206; 16: 29 / 249. Before, with tiles of 128 and the head in 16-row GEMMs:
55 / 210 (a 16-row GEMM of the head's 32,000 columns took 8.4 ms, one row 1.1).

Whatever kernel a machine picks for those fixed shapes, it picks it for every split alike, so a
row's floats depend only on its inputs. Elementwise ops, norms and softmax are per row already.
This is what the exactness tests check with `torch.equal`, under several MKL kernel paths.

K and V share the latent (MQA with one shared head, as V4); rotary position on the first
`rope_dim` dims of queries and keys only: values stay position-free.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from kvledger.engine.models.fixed_rows import place_rows

TILE = 32


class Rope:
    """Rotary position on the first `dim` dims (half-split pairs); cos/sin tables grow on demand."""

    def __init__(self, dim: int, base: float) -> None:
        self.dim, self.base = dim, base
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None

    def _tables(self, n: int, like: Tensor) -> tuple[Tensor, Tensor]:
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != like.device:
            size = max(2 * n, 4096)
            half = self.dim // 2
            freqs = self.base ** (-torch.arange(half, dtype=torch.float64) / half)
            angles = torch.arange(size, dtype=torch.float64)[:, None] * freqs[None, :]
            self._cos = angles.cos().to(like.device, like.dtype)
            self._sin = angles.sin().to(like.device, like.dtype)
        return self._cos, self._sin

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x[..., d] by `positions` (x's leading dims, or all but d's last one); negative positions: 0."""
        cos, sin = self._tables(int(positions.max().item()) + 1 if positions.numel() else 1, x)
        positions = positions.clamp(min=0)
        cos, sin = cos[positions], sin[positions]
        half = self.dim // 2
        a, b, rest = x[..., :half], x[..., half:self.dim], x[..., self.dim:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)


class Compressed(NamedTuple):
    """The compressed keys of one query tile: shared ([n, d], HCA) or per query ([q, k, d], CSA)."""

    keys: Tensor    # roped
    values: Tensor
    valid: Tensor   # [q, n] or [q, k] bool


def tile_keys(t0: int, window: int, base: int) -> slice:
    """The keys of the query tile holding t0, as a slice of `canonical_keys`' rows: TILE + window of them, a
    span fixed by the tile's absolute position whatever the split."""
    t = t0 // TILE * TILE
    return slice(t - window - base, t + TILE - base)


def tiles(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) cut at multiples of TILE."""
    out, start = [], lo
    while start < hi:
        end = min((start // TILE + 1) * TILE, hi)
        out.append((start, end))
        start = end
    return out


def canonical_keys(rows: Tensor, first: int, lo: int, hi: int, window: int) -> tuple[Tensor, int]:
    """Window keys laid out so that the tile at [t, t + TILE) reads positions [t − window, t + TILE) (`tile_keys`).

    `rows` hold positions [first, hi), first >= lo − window + 1. Returns (keys, base): keys[j] is position
    base + j, zeros where no row is held (always masked: before the window, or in the future of every query)."""
    base = lo // TILE * TILE - window
    end = ((hi - 1) // TILE + 1) * TILE
    keys = rows.new_zeros(end - base, rows.shape[1])
    keys[first - base:hi - base] = rows
    return keys, base


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int, floor: int) -> Tensor:
    """[q, k] bool: key j is in query i's window: max(floor, i − W + 1) <= j <= i."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window) & (k_pos[None, :] >= floor)


def attend(q: Tensor, win_k: Tensor, win_v: Tensor, win_valid: Tensor, comp: Compressed | None,
           slot: int) -> Tensor:
    """One tile. q [h, q, d] roped, its first query at `slot` of the tile; win_k/win_v [k, d];
    returns [q, h·d]. Rows with no key give 0. Every product runs over the tile's TILE query rows."""
    n_q, n_win = q.shape[1], win_k.shape[0]
    q, win_valid = place_rows(q, 1, slot, TILE), place_rows(win_valid, 0, slot, TILE)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("hqd,kd->hqk", q, win_k) * scale
    scores = scores.masked_fill(~win_valid[None], float("-inf"))
    if comp is not None:
        keys, values, valid = comp
        if keys.dim() == 3:
            keys, values = place_rows(keys, 0, slot, TILE), place_rows(values, 0, slot, TILE)
        eq = "hqd,qkd->hqk" if keys.dim() == 3 else "hqd,kd->hqk"
        cs = torch.einsum(eq, q, keys) * scale
        scores = torch.cat([scores, cs.masked_fill(~place_rows(valid, 0, slot, TILE)[None], float("-inf"))], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a row with no key at all (masked YoCo rows) attends nothing
    out = torch.einsum("hqk,kd->hqd", probs[..., :n_win], win_v)
    if comp is not None:
        eq = "hqk,qkd->hqd" if values.dim() == 3 else "hqk,kd->hqd"
        out = out + torch.einsum(eq, probs[..., n_win:], values)
    return out[:, slot:slot + n_q].permute(1, 0, 2).reshape(n_q, -1)


class Entries(NamedTuple):
    """A layer's compressed entries for one forward, zero-padded to what its last tile may see."""

    values: Tensor        # [n, d]
    keys: Tensor          # [n, d], roped at each entry's last position (g + 1)·ratio − 1
    index: Tensor | None  # [n, di] CSA index keys
    closed: int           # entries actually held (the rest is padding, masked for every query)


def prepare_entries(entries: Tensor, index_keys: Tensor | None, ratio: int, last_tile: int, rope: Rope) -> Entries:
    n = max((last_tile + 1) * TILE // ratio, entries.shape[0])
    values = _padded(entries, n)
    g = torch.arange(n, device=entries.device)
    index = _padded(index_keys, n) if index_keys is not None else None
    return Entries(values, rope.apply(values, (g + 1) * ratio - 1), index, entries.shape[0])


def _padded(rows: Tensor, n: int) -> Tensor:
    if rows.shape[0] >= n:
        return rows
    return torch.cat([rows, rows.new_zeros(n - rows.shape[0], rows.shape[1])])


def hca_keys(entries: Entries, q_pos: Tensor, tile: int, ratio: int) -> Compressed:
    """Every entry a query of tile `tile` may see (n = (tile + 1)·TILE / ratio), masked by g < ⌊(i + 1) / ratio⌋."""
    n = (tile + 1) * TILE // ratio
    g = torch.arange(n, device=q_pos.device)
    valid = g[None, :] < ((q_pos + 1) // ratio)[:, None]
    assert entries.closed >= int(((q_pos[-1] + 1) // ratio).item()), "entries of closed groups are missing"
    return Compressed(entries.keys[:n], entries.values[:n], valid)


def csa_keys(entries: Entries, iq: Tensor, iw: Tensor, q_pos: Tensor, tile: int, ratio: int, top_k: int) -> Compressed:
    """The indexer's top-k closed entries per query: score(i, g) = Σ_h w_h(i) · relu(q_h(i) · k_g).

    iq [q, hi, di], iw [q, hi]. Fewer than k closed entries: all of them (the rest masked)."""
    n = (tile + 1) * TILE // ratio
    g = torch.arange(n, device=q_pos.device)
    valid = g[None, :] < ((q_pos + 1) // ratio)[:, None]
    assert entries.closed >= int(((q_pos[-1] + 1) // ratio).item()), "entries of closed groups are missing"
    slot, n_q = int(q_pos[0]) % TILE, q_pos.shape[0]
    iq = place_rows(iq, 0, slot, TILE)
    score = (iq.reshape(-1, iq.shape[-1]) @ entries.index[:n].T).view(iq.shape[0], iq.shape[1], n).relu_()
    score = (score * place_rows(iw, 0, slot, TILE)[..., None]).sum(dim=1)[slot:slot + n_q]
    score = score.masked_fill(~valid, float("-inf"))
    top, idx = torch.topk(score, min(top_k, n), dim=-1)
    return Compressed(entries.keys[idx], entries.values[idx], torch.isfinite(top))
