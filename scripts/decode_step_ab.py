"""One SmolLM2 decode forward, two ways interleaved: the measurement behind docs/engine.md's decode table.

    .venv/bin/python scripts/decode_step_ab.py attention [--context 2304] [--threads 2]
    .venv/bin/python scripts/decode_step_ab.py bf16 [--context 2304] [--threads 2]
    .venv/bin/python scripts/decode_step_ab.py stacked [--context 2304] [--threads 2] [--queries 1]
    .venv/bin/python scripts/decode_step_ab.py mirror [--context 2304] [--threads 2]
    .venv/bin/python scripts/decode_step_ab.py operators [--context 2304] [--threads 2]
    .venv/bin/python scripts/decode_step_ab.py gemv [--context 2304] [--threads 2]
    .venv/bin/python scripts/decode_step_ab.py attend [--context 2304] [--threads 2]

`attention`: the one-query attention as it was (`PagedKV.gather`, then SDPA with `enable_gqa`) against
`Attention._attend_one`. `bf16`: float32 weights (in oneDNN, `onednn.Linear`) against every `Linear` in bf16
(an experiment, not a mode of the engine). `stacked`: HF's q, k, v projections and gate, up projections as
five matmuls, as they were, against the engine's two stacked ones (`llama._stacked`). `mirror`: decode steps
reading K and V from the blocks (`PagedKV.gather_heads`, a chunk without a sequence id) against reading them from
the sequence's decode mirror (`decode_mirror`); its 5 forwards of a round are 5 successive decode steps after
an untimed one at position `--context`, which builds the mirror (the other side's forwards drop it).
`operators`: decode steps (both sides mirrored) with a layer's small operators as they were (HF's seven-operator
rotation once for Q and once for K, the six-operator RMSNorm, a KV write through index tensors, one chunk sliced
and concatenated) against the engine's. `gemv`: decode steps (both sides mirrored) with every matmul in oneDNN
against the engine's, whose one-row matmuls run in kvledger's kernel (`models/gemv.py`). `attend`: decode steps
(both sides mirrored) with the one-query attention in SDPA against the engine's kernel (`models/attend.py`). The
prompt
(random ids) is prefilled once; then `--rounds` rounds of 5 forwards of one query at position `--context` (or
of the `--queries` positions up to it: a prefill chunk), the sides alternating. Prints per side the median ms of a
forward over the rounds after the first 2 (warm-up) and the min–max of all, and the last logits' max
|difference| over max |logit|.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.engine.models import attend, gemv, llama, onednn
from kvledger.engine.models.base import Chunk, PagedKV
from kvledger.engine.models.rowwise import rotate
from kvledger.engine.models.registry import resolve
from kvledger.engine.sequence import new_uid


def old_attend_one(self: llama.Attention, q: torch.Tensor, c: Chunk, cache: llama.PagedKV) -> torch.Tensor:
    k, v = cache.gather(c.block_table, c.end, q.dtype)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True).squeeze(0).transpose(0, 1)


def separate_qkv(self: llama.Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Attention.qkv` with its three projections apart (the weights split back from `qkv_proj`)."""
    t = x.shape[0]
    wq, wk, wv = self.qkv_proj.weight.split(self.widths)
    return (rotate(matmul(x, wq).view(t, self.heads, self.head_dim), cos, sin),
            rotate(matmul(x, wk).view(t, self.kv_heads, self.head_dim), cos, sin),
            matmul(x, wv).view(t, self.kv_heads, self.head_dim))


def separate_mlp(self: llama.DecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """`DecoderLayer.mlp` with gate and up apart."""
    wg, wu = self.gate_up_proj.weight.chunk(2)
    return self.down_proj(F.silu(matmul(h, wg)) * matmul(h, wu))


def old_rms_norm(self: llama.RMSNorm, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    if add is not None:   # the residual add the engine's norm now takes in, in place as it does
        x.add_(add)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def old_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def old_rope(self: llama.Llama, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def old_qkv(self: llama.Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = x.shape[0]
    q, k, v = self.qkv_proj(x).split(self.widths, dim=-1)
    return (old_rotate(q.view(t, self.heads, self.head_dim), cos, sin),
            old_rotate(k.view(t, self.kv_heads, self.head_dim), cos, sin), v.view(t, self.kv_heads, self.head_dim))


def old_attention(self: llama.Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  chunks: list[Chunk], cache: PagedKV) -> torch.Tensor:
    q, k, v = self.qkv(x, cos, sin)
    outs, off = [], 0
    for c in chunks:
        n = c.end - c.start
        cache.write(c.block_table, c.start, k[off:off + n], v[off:off + n])
        outs.append(self._attend(q[off:off + n], c, cache))
        off += n
    return self.o_proj(torch.cat(outs).reshape(x.shape[0], -1))


def old_write(self: PagedKV, block_table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    pos = torch.arange(start, start + k.shape[0], device=k.device)
    blocks = block_table[pos // self.block_size]
    assert bool((blocks != 0).all())
    offs = pos % self.block_size
    self.kv[blocks, 0, offs] = k.to(self.dtype)
    self.kv[blocks, 1, offs] = v.to(self.dtype)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ as `onednn.Linear` computes it."""
    if gemv.fits(x, w):
        return gemv.gemv(x, w)
    if onednn.AVAILABLE:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
    return F.linear(x, w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("compare", choices=("attention", "bf16", "stacked", "mirror", "operators", "gemv", "attend"))
    p.add_argument("--context", type=int, default=2304)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--queries", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = resolve("smollm2-135m").load("cpu")
    b, n = 128, a.context
    mirrored = a.compare in ("mirror", "operators", "gemv", "attend")
    model.allocate((4 if mirrored else 1) * (n // b + 3), 0)   # mirror: a pool its budget fits in
    table = torch.arange(1, n // b + 3)
    ids = torch.randint(100, 40_000, (n + 6,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for s in range(0, n, 1024):
            model([Chunk(ids[s:min(n, s + 1024)], s, table)])
    patched = ((llama.Attention, "_attend_one"), (onednn.Linear, "forward"), (llama.Attention, "qkv"),
               (llama.DecoderLayer, "mlp"), (llama.RMSNorm, "forward"), (llama.Llama, "_rope"),
               (llama.Attention, "forward"), (PagedKV, "write"), (gemv, "AVAILABLE"),
               (attend, "AVAILABLE"))
    own = {where: getattr(*where) for where in patched}
    bf16 = {id(m): m.weight.data.to(torch.bfloat16) for m in model.modules() if isinstance(m, nn.Linear)}

    def bf16_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), bf16[id(self)]).float()

    sides = {"attention": {"before": {patched[0]: old_attend_one}, "after": {}},
             "bf16": {"float32": {}, "bf16": {patched[1]: bf16_linear}},
             "stacked": {"separate": {patched[2]: separate_qkv, patched[3]: separate_mlp}, "stacked": {}},
             "mirror": {"blocks": {}, "mirror": {}},
             "operators": {"before": {patched[2]: old_qkv, patched[4]: old_rms_norm, patched[5]: old_rope,
                                      patched[6]: old_attention, patched[7]: old_write}, "after": {}},
             "gemv": {"onednn": {patched[8]: False}, "gemv": {}},
             "attend": {"sdpa": {patched[9]: False}, "kernel": {}},
             }[a.compare]
    # the sides' sequence ids: a chunk without one (-1) reads the blocks
    seqs = {"mirror": {"mirror": new_uid()}, "operators": {"before": new_uid(), "after": new_uid()},
            "gemv": {"onednn": new_uid(), "gemv": new_uid()},
            "attend": {"sdpa": new_uid(), "kernel": new_uid()}}.get(a.compare, {})
    times: dict[str, list[float]] = {name: [] for name in sides}
    logits: dict[str, torch.Tensor] = {}
    q = a.queries
    try:
        for _ in range(a.rounds):
            for name, patches in sides.items():
                for where, fn in (own | patches).items():
                    setattr(*where, fn)
                if mirrored:   # the untimed step that builds the mirror
                    with torch.inference_mode():
                        model([Chunk(ids[n:n + 1], n, table, seq=seqs.get(name, -1))])
                t = time.perf_counter()
                with torch.inference_mode():
                    for i in range(5):
                        if mirrored:   # successive decode steps after it
                            chunk = Chunk(ids[n + 1 + i:n + 2 + i], n + 1 + i, table, seq=seqs.get(name, -1))
                        else:
                            chunk = Chunk(ids[n + 1 - q:n + 1], n + 1 - q, table)
                        logits[name] = model([chunk])
                times[name].append((time.perf_counter() - t) / 5 * 1e3)
    finally:
        for where, fn in own.items():
            setattr(*where, fn)
    for name, ts in times.items():
        print(f"{name:>8}: {statistics.median(ts[2:]):.1f} ms ({min(ts):.1f}–{max(ts):.1f})")
    first, second = logits.values()
    print(f"logits: max |difference| / max |logit| = {float((first - second).abs().max() / first.abs().max()):.1e}, "
          f"same argmax: {bool(first.argmax() == second.argmax())}")


if __name__ == "__main__":
    main()
