"""A prompt chunk's causal attention over keys [0, end) read back from the blocks; in bf16 where asked and exact.

The engine keeps K and V in bf16 blocks and by default attends in float32, as `vllm serve --dtype float32` does.
Converting the blocks to float32 for torch's flash kernel makes a prompt chunk's attention the largest cost of a
SmolLM2 hit on the 2-core Xeon (AVX-512, AMX): 8.5 ms a layer for 256 queries over 2,304 keys, against 3.4 ms with
Q rounded to bf16 to meet K and V; 32 against 12 ms for a cold 2,304-token prompt (`scripts/prompt_attend_ab.py`
measures whole forwards). In bf16 the flash kernel multiplies bf16 tiles (AMX, or AVX-512 BF16) and sums in
float32, as a bf16 server's attention does; Q and the softmax's probabilities are rounded to bf16 on the way in,
the output on the way out. `KVLEDGER_BF16_PREFILL=1` asks for it. Against transformers' float32 SmolLM2 the logits
stay within the bf16 blocks' own error (`tests/engine/models/test_llama.py`).

Those roundings magnify a last-bit difference: a hit whose rows were computed in another float32 order than the
cold prefill's (another kernel for fewer rows) moved the logits by 7e-4 of the largest with bf16 attention,
against 4e-5 with float32. So bf16 is taken only where a row's floats do not depend on how many rows share its
products, checked on this CPU at the thread count in use (`Llama.bf16_prompts`): the model's matmuls
(`onednn.rows_invariant`) and this attention (`rows_invariant` below). The keys are padded with zeros to whole
tiles of the kernel (`KV_TILE`), so a query meets its keys in the same tiles in a chunk of any length; one query
is computed as the first of two. A prompt's last token attends in float32 over the mirror and takes a decode
step's matmul kernel (`llama.ends_in_step`). There a hit's rows are the cold prefill's, bit for bit.

What bf16 prompts give up: a row computed as a decode step in one request (the first generated token, or a
prompt's last token) and as a prompt row in another (a next turn, or a P/D decode leg that recomputes its tail
after the hand-off failed) now differs by bf16's rounding, not float32's, so such a recompute may continue with
another greedy token where float32 would not. That is why it is not the default.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

KV_TILE = 512   # torch 2.13's flash kernel takes the keys in tiles of 512 (of all of them when fewer)
PROBE_QUERIES = (1, 2, 17, 64, 300)   # chunk lengths `rows_invariant` compares with a whole prompt's rows


def wanted() -> bool:
    """bf16 attention for prompt chunks is asked for (`KVLEDGER_BF16_PREFILL=1`; off by default)."""
    return os.environ.get("KVLEDGER_BF16_PREFILL", "0") == "1"


def padded_length(end: int) -> int:
    """Keys [0, end) padded to whole key tiles: every query then meets its keys in the same tiles, tile by tile,
    however many keys its chunk has (a tile's sum of probabilities runs over the tile's width)."""
    return -(-end // KV_TILE) * KV_TILE


def causal(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """softmax(q · kᵀ / √d + causal mask) · v for queries at positions [start, start + n): q [n, heads, d], k and
    v [>= start + n, kv_heads, d], zeros (or any finite values) after start + n, with heads a multiple of kv_heads
    (query head i reads KV head i // group) → [n, heads, d] in q's dtype. The computation runs in k's dtype.

    A chunk after the first takes a mask, as is_causal aligns its diagonal at key 0; one query is computed as the
    first of two, as torch's one-query kernel differs from its tiled one."""
    n, end, dtype = q.shape[0], start + q.shape[0], q.dtype
    assert k.shape == v.shape and k.shape[0] >= end and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape, start)
    q = q.to(k.dtype)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q if n > 1 else torch.cat((q, q)), k, v))
    if start == 0:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=_mask(start, n, k.shape[0], k.dtype, k.device),
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)[:n].to(dtype)


@functools.lru_cache(maxsize=2)
def _mask(start: int, n: int, keys: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive causal mask of queries [start, start + n) over `keys` keys: 0 where a query sees the key,
    −inf elsewhere; two rows for one query (`causal`). Made once for a forward's layers (the same bits as a
    bool mask, which torch turns into this one at every call)."""
    rows = torch.arange(start, start + max(n, 2), device=device).clamp_(max=start + n - 1).unsqueeze(1)
    hidden = torch.arange(keys, device=device).unsqueeze(0) > rows
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def rows_invariant(heads: int, kv_heads: int, head_dim: int, max_keys: int, dtype: torch.dtype) -> bool:
    """Whether `causal` in `dtype`, over keys padded to whole tiles, gives each query the same floats as one of a
    chunk of any of `PROBE_QUERIES` lengths (ending at eight positions), of a shorter prompt, or of a whole prompt
    of `max_keys`, on this CPU and torch's thread count now; False too where torch's kernel fails here (torch
    2.13's bf16 kernel does when `ATEN_CPU_CAPABILITY` lowers its kernels below the CPU's AMX). A check over the
    lengths that decide the kernel's tiling, with enough rows that a last-bit difference shows in the rounding
    to bf16 of some; not a proof for every length."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(max_keys, heads, head_dim, generator=gen) * 3   # scores of a few units, as a model's are
    kv = (torch.randn(2, padded_length(max_keys), kv_heads, head_dim, generator=gen) * 3).to(dtype)

    def keys(end: int) -> tuple[Tensor, Tensor]:
        out = torch.zeros(2, padded_length(end), kv_heads, head_dim, dtype=dtype)
        out[:, :end] = kv[:, :end]
        return out[0], out[1]

    try:
        with torch.inference_mode():
            whole = causal(q, *keys(max_keys), 0)
            ends = [max_keys - i * (max_keys // 8) for i in range(8)]
            for end in (ends[3], 129):
                if not torch.equal(causal(q[:end], *keys(end), 0), whole[:end]):
                    return False
            for n in PROBE_QUERIES:
                for end in ends:
                    if not torch.equal(causal(q[end - n:end], *keys(end), end - n), whole[end - n:end]):
                        return False
    except RuntimeError:
        return False
    return True
