"""tiny-v4: DeepSeek-V4's attention structure at toy size, random weights from a fixed seed.

Layers (`ModelSpec.preset("tiny-v4")`): 0-1 SWA, 2 CSA, 3 HCA (the encoder, whose windows a
snapshot stores), then 4 CSA, 5 HCA, 6 CSA, 7 HCA (the YoCo consumers). Every layer has a 128-token
sliding window over a 64-dim latent (K = V); CSA adds one entry per 4 tokens and a lightning
indexer picking the top-k entries per query; HCA one entry per 128 tokens, all attended.

What a prefill of a prompt of L tokens computes (the model's definition, cold or resumed alike):

    rows                  layers        keys of the sliding window (query i)
    [0, L)                encoder 0-3   max(floor, i − 127) .. i       floor = 0, or s after a truncation
    [0, L)                consumer      compressor only: entries from the encoder's last hidden state
    [a, L), a = L − 134   consumer 4-7  max(a, i − 127) .. i           YoCo: the window starts at anchor a

The consumer layers never see a position before the anchor a = L − yoco_keep (134 = W + K =
R of rule 3). Any hit position P <= L − R is therefore <= a: on a resume at P the consumer
windows are recomputed from a on, from encoder rows that the resume computes anyway, and the
logits equal the cold prefill's. Decode continues with the same anchor. Only positions >= a get
logits. `yoco="mask"` computes the consumer layers over the whole kvstore ring of the chunk
(up to 396 rows) and masks the keys below a; `yoco="compact"` computes only the rows from a on.
Both give the same logits (tests: relative L2 <= 1e-5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from kvledger.core.spec import LayerKind, ModelSpec
from kvledger.engine.models.base import BeforeLayer, Chunk, Model
from kvledger.engine.models.fixed_rows import mm_rows
from kvledger.engine.models.tiny_v4_cache import TinyV4LayerCache
from kvledger.engine.models.tiny_v4_engine import engine_forward
from kvledger.engine.models.tiny_v4_layers import MLP, Attention, RMSNorm
from kvledger.engine.models.tiny_v4_state import SeqState, block_layout, empty_state, yoco_anchor

YocoMode = Literal["compact", "mask"]


@dataclass(frozen=True, slots=True)
class TinyV4Config:
    """Sizes of tiny-v4; the KV sizes must match the spec (checked by `TinyV4`)."""

    vocab_size: int = 32000
    hidden: int = 128
    heads: int = 2           # query heads over the one shared latent head (head dim = latent_dim)
    mlp_hidden: int = 384
    latent_dim: int = 64     # sliding-window latent and compressed entry: 64 × fp16 = 128 B
    index_dim: int = 32      # CSA indexer key: 32 × fp16 = 64 B per entry
    index_heads: int = 2
    top_k: int = 64          # CSA entries attended per query
    window: int = 128
    rope_dim: int = 32
    rope_base: float = 10000.0
    eos_token_id: int = 2
    seed: int = 0


class Layer(nn.Module):
    def __init__(self, gen: torch.Generator, cfg: TinyV4Config, kind: LayerKind, ratio: int | None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(gen, cfg, kind, ratio)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = MLP(gen, cfg.hidden, cfg.mlp_hidden)


class TinyV4(Model):
    """The model. `step` runs one chunk of one sequence against its own `SeqState` (tests, paths);
    `forward` runs the engine's chunks against the device caches (`base.Model`)."""

    def __init__(self, cfg: TinyV4Config | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyV4Config()
        self.spec = spec = ModelSpec.preset("tiny-v4")
        assert cfg.window == spec.window and cfg.latent_dim * 2 == spec.swa_bytes_per_token
        self.layout = block_layout(spec, cfg.latent_dim, cfg.index_dim)
        parts = {part.layer: part for part in self.layout}
        self.encoder_layers = spec.swa_stored_layers
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden, generator=gen), requires_grad=False)
        self.layers = nn.ModuleList(Layer(gen, cfg, kind, self._ratio(kind)) for kind in spec.layers)
        self.encoder_norm = RMSNorm(cfg.hidden)
        self.final_norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Parameter(torch.randn(cfg.hidden, cfg.vocab_size, generator=gen) * cfg.hidden ** -0.5,
                                    requires_grad=False)
        self.to(device=device, dtype=dtype)
        self.dtype = dtype
        self.caches = [TinyV4LayerCache(spec, i, parts.get(i), cfg.latent_dim, cfg.index_dim)
                       for i in range(spec.n_layers)]
        self.vocab_size, self.eos_token_ids, self.max_model_len = cfg.vocab_size, (cfg.eos_token_id,), 131072

    def _ratio(self, kind: LayerKind) -> int | None:
        return {LayerKind.CSA: self.spec.csa_ratio, LayerKind.HCA: self.spec.hca_ratio}.get(kind)

    def new_state(self, prompt_len: int, *, pos: int = 0, floor: int = 0) -> SeqState:
        """An empty state at `pos` (a block boundary) for a prompt of `prompt_len` tokens."""
        anchor = yoco_anchor(prompt_len, self.spec)
        assert pos <= anchor or pos == 0, f"a resume at {pos} must not pass the YoCo anchor {anchor}"
        state = empty_state(self.spec, self.cfg.latent_dim, self.cfg.index_dim, pos=pos, anchor=anchor,
                            floor=floor, device=self.device, dtype=self.dtype)
        state.exact = floor == 0
        return state

    def forward(self, chunks: Sequence[Chunk], before_layer: BeforeLayer | None = None) -> Tensor:
        """The engine's forward over its device caches (`tiny_v4_engine`)."""
        return engine_forward(self, chunks, before_layer)

    @torch.inference_mode()
    def step(self, state: SeqState, tokens: Tensor, *, yoco: YocoMode = "compact", compress: bool = True,
             all_logits: bool = False) -> Tensor | None:
        """Compute positions [state.pos, state.pos + len(tokens)) of one sequence held in `state`; return the
        logits of the last row (with `all_logits`, of every row >= the anchor), None when no row reaches it.

        `compress=False` (bounded replay): the encoder rebuilds its windows only; entries come from
        the block ledger and are neither recomputed nor overwritten."""
        q0, q1 = state.pos, state.pos + len(tokens)
        x = self.embed[tokens.to(self.device)]
        for i in range(self.encoder_layers):
            x = self.encode(state, i, x, q0, compress)
        h = self.encoder_norm(x)
        lo = self._consumer_start(state, q0, q1, yoco) if q1 > state.anchor else q1
        y = x[lo - q0:]
        for i in range(self.encoder_layers, self.spec.n_layers):
            y = self.consume(state, i, h, y, lo, compress)
        self._finish(state, q1)
        if lo >= q1:
            return None
        first = max(state.anchor, lo) if all_logits else q1 - 1
        return self.head(y[first - lo:])

    def encode(self, state: SeqState, i: int, x: Tensor, lo: int, compress: bool) -> Tensor:
        """Encoder layer i over rows [lo, lo + len(x)) (state.pos = lo)."""
        return self._layer(state, i, x, lo, state.floor, compress)

    def consume(self, state: SeqState, i: int, h: Tensor, y: Tensor, lo: int, compress: bool) -> Tensor:
        """Consumer layer i: its compressor reads the encoder's last hidden state h (rows from state.pos);
        the layer computes rows [lo, lo + len(y)) (lo >= the anchor; none when y is empty)."""
        if compress:
            self.layers[i].attn.compressor.update(state, i, h)
        return self._layer(state, i, y, lo, state.anchor, False) if y.shape[0] else y

    def head(self, y: Tensor) -> Tensor:
        """Logits of the rows of y, each computed alone (`mm_rows`)."""
        return mm_rows(self.final_norm(y), self.lm_head)

    def _consumer_start(self, state: SeqState, q0: int, q1: int, yoco: YocoMode) -> int:
        """First row the consumer layers compute in this chunk (see the module docstring)."""
        window = state.windows[self.encoder_layers]
        if window.end > window.start or yoco == "compact":
            lo = max(q0, state.anchor) if window.end == window.start else q0
        else:
            lo = max(q0, q1 - self.spec.kvstore_ring())
            assert lo <= state.anchor, "mask mode: the ring must reach back to the anchor"
            for i in range(self.encoder_layers, self.spec.n_layers):
                state.windows[i].start = lo
        return lo

    def _layer(self, state: SeqState, i: int, x: Tensor, lo: int, floor: int, compress: bool) -> Tensor:
        layer = self.layers[i]
        xn = layer.attn_norm(x)
        state.windows[i].append(lo, layer.attn.latent(xn, lo))
        if compress and layer.attn.compressor is not None:
            layer.attn.compressor.update(state, i, xn)
        x = x + layer.attn(state, i, xn, lo, floor)
        return x + layer.mlp(layer.mlp_norm(x), lo)

    def _finish(self, state: SeqState, q1: int) -> None:
        state.pos = q1
        ring = self.spec.kvstore_ring()
        for window in state.windows:
            window.trim(ring)


def load_tiny_v4(folder: None, spec: ModelSpec, device: torch.device) -> TinyV4:
    """The engine's loader (`registry.ModelEntry.load`): tiny-v4 with its fixed-seed weights on `device`
    (no folder: the weights come from the seed)."""
    model = TinyV4(device=device)
    assert model.spec == spec
    return model
