"""tiny-v4's layers: norm, MLP, the compressor (gated pooling of closed groups), and one attention layer.

A layer of kind SWA has only its sliding window; CSA and HCA add compressed entries (CSA also the
lightning indexer). The compressor of an encoder layer reads the layer's own input; the compressor
of a YoCo consumer layer reads the encoder's last hidden state (that is what lets the block ledger
hold consumer KV while the consumer's own window is recomputed).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvledger.core.spec import LayerKind
from kvledger.engine.models.fixed_rows import mm
from kvledger.engine.models.tiny_v4_attention import (
    TILE,
    Compressed,
    Entries,
    Rope,
    attend,
    canonical_keys,
    csa_keys,
    hca_keys,
    prepare_entries,
    tile_keys,
    tiles,
    window_mask,
)
from kvledger.engine.models.tiny_v4_state import SeqState, Tail, round16


def _param(gen: torch.Generator, *shape: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen) * std, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """SwiGLU: down(silu(x·gate) * (x·up))."""

    def __init__(self, gen: torch.Generator, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = _param(gen, dim, 2 * hidden, std=dim ** -0.5)
        self.down = _param(gen, hidden, dim, std=hidden ** -0.5)

    def forward(self, x: Tensor, first: int) -> Tensor:
        """Rows of positions [first, first + len(x))."""
        gate, up = mm(x, self.gate_up, first).chunk(2, dim=-1)
        return mm(nn.functional.silu(gate) * up, self.down, first)


class GatedPool(nn.Module):
    """One entry per closed group of `ratio` rows: Σ_j softmax_j(gate_j + bias_j) ⊙ kv_j (per dim)."""

    def __init__(self, gen: torch.Generator, dim: int, out: int, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.kv_gate = _param(gen, dim, 2 * out, std=dim ** -0.5)
        self.bias = _param(gen, ratio, out, std=0.5)

    def project(self, u: Tensor, first: int) -> tuple[Tensor, Tensor]:
        """Rows of positions [first, first + len(u))."""
        kv, gate = mm(u, self.kv_gate, first).chunk(2, dim=-1)
        return kv, gate

    def pool(self, kv: Tensor, gate: Tensor) -> Tensor:
        """kv, gate [G·ratio, out] (closed groups only) → [G, out], rounded to fp16."""
        groups = kv.shape[0] // self.ratio
        weights = torch.softmax(gate.view(groups, self.ratio, gate.shape[1]) + self.bias, dim=1)
        return round16((weights * kv.view(groups, self.ratio, kv.shape[1])).sum(dim=1))


class Compressor(nn.Module):
    """The entries (and, for CSA, the index keys) of one layer; the open group waits in `state.tails`."""

    def __init__(self, gen: torch.Generator, dim: int, latent: int, index_dim: int, ratio: int, csa: bool) -> None:
        super().__init__()
        self.ratio = ratio
        self.main = GatedPool(gen, dim, latent, ratio)
        self.index = GatedPool(gen, dim, index_dim, ratio) if csa else None

    def update(self, state: SeqState, layer: int, u: Tensor) -> None:
        """Feed the rows of positions [state.pos, state.pos + len(u)); close every group they complete."""
        tail = state.tails[layer]
        assert tail is not None and tail.n == state.pos % self.ratio, f"layer {layer}: open group out of step"
        kv, gate = self.main.project(u, state.pos)
        kv, gate = torch.cat([tail.kv, kv]), torch.cat([tail.gate, gate])
        closed = kv.shape[0] // self.ratio * self.ratio
        state.entries[layer] = torch.cat([state.entries[layer], self.main.pool(kv[:closed], gate[:closed])])
        new_tail = Tail(kv[closed:], gate[closed:])
        if self.index is not None:
            ikv, igate = self.index.project(u, state.pos)
            ikv, igate = torch.cat([tail.index_kv, ikv]), torch.cat([tail.index_gate, igate])
            keys = self.index.pool(ikv[:closed], igate[:closed])
            state.index_keys[layer] = torch.cat([state.index_keys[layer], keys])
            new_tail.index_kv, new_tail.index_gate = ikv[closed:], igate[closed:]
        state.tails[layer] = new_tail


class Attention(nn.Module):
    """One layer's attention: queries, the shared K=V latent, optional compressor and indexer."""

    def __init__(self, gen: torch.Generator, cfg, kind: LayerKind, ratio: int | None) -> None:  # noqa: ANN001
        super().__init__()
        d, h, lat = cfg.hidden, cfg.heads, cfg.latent_dim
        self.kind, self.ratio, self.heads, self.top_k, self.window = kind, ratio, h, cfg.top_k, cfg.window
        self.rope = Rope(cfg.rope_dim, cfg.rope_base)
        self.wq = _param(gen, d, h * lat, std=d ** -0.5)
        self.wkv = _param(gen, d, lat, std=d ** -0.5)
        self.wo = _param(gen, h * lat, d, std=(h * lat) ** -0.5)
        comp = kind in (LayerKind.CSA, LayerKind.HCA)
        csa = kind is LayerKind.CSA
        self.compressor = Compressor(gen, d, lat, cfg.index_dim, ratio, csa) if comp else None
        self.index_q = _param(gen, d, cfg.index_heads * (cfg.index_dim + 1), std=d ** -0.5) if csa else None
        self.index_heads, self.index_dim = cfg.index_heads, cfg.index_dim

    def latent(self, xn: Tensor, first: int) -> Tensor:
        """The sliding-window latent (K = V) of the rows of positions [first, ...), as stored (fp16 values)."""
        return round16(mm(xn, self.wkv, first))

    def forward(self, state: SeqState, layer: int, xn: Tensor, lo: int, floor: int) -> Tensor:
        """Attention output of rows at positions [lo, lo + len(xn)), whose latents the window holds already.

        Keys: the window's rows from max(start, lo − W + 1); the mask hides those below `floor`."""
        hi, need = lo + xn.shape[0], max(floor, lo - self.window + 1)
        window = state.windows[layer]
        assert window.start <= need, f"layer {layer}: window starts at {window.start}, rows from {lo} need {need}"
        first = max(window.start, lo - self.window + 1)
        keys, base = canonical_keys(window.rows(first, hi), first, lo, hi, self.window)
        k_pos = torch.arange(base, base + keys.shape[0], device=xn.device)
        q_pos = torch.arange(lo, hi, device=xn.device)
        q = self.rope.apply(mm(xn, self.wq, lo).view(-1, self.heads, keys.shape[1]).transpose(0, 1), q_pos)
        k_roped = self.rope.apply(keys, k_pos)
        idx = None
        if self.index_q is not None:
            idx = mm(xn, self.index_q, lo).view(-1, self.index_heads, self.index_dim + 1)
        entries = None
        if self.kind in (LayerKind.CSA, LayerKind.HCA):
            entries = prepare_entries(state.entries[layer], state.index_keys[layer], self.ratio, (hi - 1) // TILE,
                                      self.rope)
        outs = []
        for t0, t1 in tiles(lo, hi):
            tile, span, rows = t0 // TILE, tile_keys(t0, self.window, base), slice(t0 - lo, t1 - lo)
            valid = window_mask(q_pos[rows], k_pos[span], self.window, floor)
            comp = self._compressed(entries, q_pos[rows], tile, None if idx is None else idx[rows])
            outs.append(attend(q[:, rows], k_roped[span], keys[span], valid, comp, t0 % TILE))
        return mm(torch.cat(outs), self.wo, lo)

    def _compressed(self, entries: Entries | None, q_pos: Tensor, tile: int, idx: Tensor | None
                    ) -> Compressed | None:
        if self.kind is LayerKind.HCA:
            return hca_keys(entries, q_pos, tile, self.ratio)
        if self.kind is LayerKind.CSA:
            return csa_keys(entries, idx[..., :-1], idx[..., -1], q_pos, tile, self.ratio, self.top_k)
        return None
