"""A prompt chunk's causal attention over keys [0, end) of the paged blocks, in float32.

The engine keeps K and V in bf16 blocks and attends in float32, as `vllm serve --dtype float32` does.
Gathering the blocks, converting them to float32 and running torch's flash kernel made a prompt chunk's attention
the largest cost of a SmolLM2 hit on the 2-core Xeon (AVX-512, AMX): 7 to 8.5 ms a layer for 256 queries over
2,304 keys, 31 to 35 ms for a cold 2,304-token prompt.

**The kernel** (`_prompt_attend.c`, `causal_blocks`) reads the bf16 blocks through the block table itself and puts
queries in the vector lanes: each K and V value is broadcast to 48 queries (16 positions × the query heads that
share its KV head), so the products run as a GEMM's do, and the softmax runs down the lanes without a horizontal
sum. On that Xeon: 5.4 ms for the hit's chunk, 23 ms for the cold prompt (`scripts/prompt_attend_ab.py` measures
whole forwards). Keys come in tiles at fixed absolute positions and every query's sums run in a fixed order, so a
query's floats do not depend on the chunk it came in, nor on the thread count: by construction, a hit's rows attend
exactly as the cold prefill's did. It needs AVX-512F (`KERNEL`); elsewhere, or with `KVLEDGER_PROMPT_ATTEND=0`,
the blocks are gathered for torch's flash kernel (`causal`), within float32 rounding of it, and a query's floats
may then depend on its chunk's length.

There is no bf16 path. One was tried (2026-12-06, `KVLEDGER_BF16_PREFILL=1`): torch's bf16 flash kernel on AMX
tiles, 15 % faster cold, exact only where a query's floats did not depend on its chunk's length, which a runtime
check over a few lengths decided. On an AMD EPYC with AVX-512 BF16 the check passed and a length it had not tried
differed, so the claim was a guess; it was removed rather than kept as an exactness no construction backs.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:   # after torch, so the kernel joins torch's OpenMP runtime (libgomp.so.1) rather than loading another
    from kvledger.engine.models import _prompt_attend
except ImportError:
    _prompt_attend = None

KERNEL: bool = (_prompt_attend is not None and _prompt_attend.available()
                and os.environ.get("KVLEDGER_PROMPT_ATTEND", "1") != "0")
KERNEL_KEY_TILE, KERNEL_MAX_D, KERNEL_MAX_GROUP = 64, 256, 64   # _prompt_attend.c's bounds


def blocks_fit(q: Tensor, pool: Tensor, block_table: Tensor) -> bool:
    """Whether `causal_blocks(q, pool, block_table, start)` applies: the kernel is available; q is CPU float32
    [n >= 1, heads, d] with contiguous heads of d (rows any distance apart); pool a contiguous CPU bf16 [blocks, 2,
    B, kv_heads, d] with B a multiple of 64; the table CPU int64, contiguous; d a multiple of 8 up to 256, up to 64
    query heads per KV head; nothing records a gradient."""
    if not KERNEL or q.dim() != 3 or pool.dim() != 5 or torch.is_grad_enabled():
        return False
    n, heads, d = q.shape
    kv_heads = pool.shape[3]
    return (n >= 1 and pool.shape[1] == 2 and pool.shape[4] == d and heads % kv_heads == 0
            and heads // kv_heads <= KERNEL_MAX_GROUP and d % 8 == 0 and d <= KERNEL_MAX_D
            and pool.shape[2] % KERNEL_KEY_TILE == 0 and q.dtype == torch.float32 and pool.dtype == torch.bfloat16
            and block_table.dtype == torch.int64 and q.device.type == pool.device.type == block_table.device.type
            == "cpu" and q.stride(2) == 1 and q.stride(1) == d and q.stride(0) >= heads * d
            and pool.is_contiguous() and block_table.is_contiguous())


def causal_blocks(q: Tensor, pool: Tensor, block_table: Tensor, start: int) -> Tensor:
    """softmax(q · kᵀ / √d + causal mask) · v for queries at positions [start, start + n), q [n, heads, d] float32,
    over keys [0, start + n) of the bf16 blocks `pool` [blocks, 2 (K, V), B, kv_heads, d] in `block_table`'s order
    (their K and V written) → [n, heads, d] float32, query head i reading KV head i // group. Each query's floats
    are the same in a chunk of any length (`_prompt_attend.c`). `blocks_fit` must hold (ValueError otherwise, and
    for a block id outside the pool)."""
    if not blocks_fit(q, pool, block_table):   # not an assert: the kernel reads raw pointers
        raise ValueError(f"causal_blocks does not apply to q {tuple(q.shape)} {q.stride()} {q.dtype}, pool "
                         f"{tuple(pool.shape)} {pool.dtype}, table {block_table.dtype}")
    n, heads, d = q.shape
    out = torch.empty(n, heads, d)
    _prompt_attend.causal(q.data_ptr(), q.stride(0), pool.data_ptr(), pool.shape[0], block_table.data_ptr(),
                          block_table.numel(), out.data_ptr(), start, n, heads, pool.shape[3], d, pool.shape[2],
                          math.log2(math.e) / math.sqrt(d), torch.get_num_threads())
    return out


def causal(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """softmax(q · kᵀ / √d + causal mask) · v for queries at positions [start, start + n) in torch's flash kernel:
    q [n, heads, d], k and v [>= start + n, kv_heads, d], any finite values after start + n, with heads a multiple
    of kv_heads (query head i reads KV head i // group) → [n, heads, d] in q's dtype. The computation runs in k's
    dtype. A chunk after the first takes a mask, as is_causal aligns its diagonal at key 0; one query is computed
    as the first of two, as torch's one-query kernel sums in another order than its tiled one."""
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


def drop_masks() -> None:
    """Free the masks `causal` made for a forward's layers; `Llama.forward` calls it as it ends (a chunk of 4,096
    queries over 8,192 keys has a mask of 134 MB)."""
    _mask.cache_clear()


@functools.lru_cache(maxsize=2)
def _mask(start: int, n: int, keys: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive causal mask of queries [start, start + n) over `keys` keys: 0 where a query sees the key,
    −inf elsewhere; two rows for one query (`causal`). Made once for a forward's layers and dropped at its end
    (`drop_masks`); the same bits as a bool mask, which torch turns into this one at every call."""
    rows = torch.arange(start, start + max(n, 2), device=device).clamp_(max=start + n - 1).unsqueeze(1)
    hidden = torch.arange(keys, device=device).unsqueeze(0) > rows
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
