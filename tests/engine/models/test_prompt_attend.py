"""A prompt chunk's attention (`prompt_attend`): kvledger's float32 kernel over the blocks (the formula, the same
floats for a query in any chunk and on any thread count, what it refuses); torch's path against float64;
`onednn.Linear`'s many-row path."""

import os
import subprocess
import sys

import pytest
import torch

from kvledger.engine.models import onednn, prompt_attend

HEADS, KV_HEADS, D = 6, 2, 32


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal grouped-query attention in float64: query head i reads KV head i // group."""
    end, group = start + q.shape[0], q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k[:end].double().repeat_interleave(group, 1), v[:end].double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) / q.shape[2] ** 0.5
    s = s.masked_fill(torch.arange(end)[None, :] > torch.arange(start, end)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vd)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


KERNEL_ONLY = pytest.mark.skipif(not prompt_attend.KERNEL, reason="kvledger's prompt kernel needs AVX-512F (and not "
                                 "KVLEDGER_PROMPT_ATTEND=0): the engine takes torch's path on this CPU")


def _blocks(end: int, kv_heads: int, d: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 pool [blocks, 2, B, kv_heads, d] with spare blocks, and a block table for keys [0, end) that takes
    them out of order."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-end // block_size) + 3
    pool = (torch.randn(blocks, 2, block_size, kv_heads, d, generator=g) * 3).bfloat16()
    return pool, torch.randperm(blocks, generator=g)[:-(-end // block_size)]


def _keys(pool: torch.Tensor, table: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of keys [0, end) as the blocks hold them, [end, kv_heads, d]."""
    kv = pool[table]
    return kv[:, 0].flatten(0, 1)[:end], kv[:, 1].flatten(0, 1)[:end]


def _queries(end: int, heads: int, d: int, seed: int) -> torch.Tensor:
    """[end, heads, d] float32 with rows further apart than heads · d, as the model's Q, a view of Q, K and V."""
    wide = torch.randn(end, heads * d + 40, generator=torch.Generator().manual_seed(seed)) * 3
    return wide[:, :heads * d].view(end, heads, d)


@KERNEL_ONLY
@pytest.mark.parametrize("heads, kv_heads, d, block_size", [(9, 3, 64, 128), (6, 2, 32, 128), (8, 2, 24, 64),
                                                            (4, 4, 16, 64)])
def test_the_blocks_kernel_is_the_formula_and_a_query_gets_the_same_floats_in_any_chunk(heads, kv_heads, d,
                                                                                        block_size):
    """Groups of 3, 4 (a pass of 3 query heads, then 1) and 1; d with and without a half vector; blocks of 128
    and 64. A chunk at any position and of any length, one query included, gives its queries the floats the
    whole prompt gave them: what makes a hit's attention the cold prefill's, bit for bit."""
    end = 700
    pool, table = _blocks(end, kv_heads, d, block_size, seed=d)
    q = _queries(end, heads, d, seed=heads)
    with torch.inference_mode():
        assert prompt_attend.blocks_fit(q, pool, table)
        whole = prompt_attend.causal_blocks(q, pool, table, 0)
        assert whole.dtype == torch.float32 and whole.shape == (end, heads, d)
        assert _rel(whole, _reference(q, *_keys(pool, table, end), 0)) <= 1e-5
        for start, n in ((0, 1), (0, 17), (699, 1), (640, 60), (100, 2), (129, 300), (555, 145), (64, 64)):
            got = prompt_attend.causal_blocks(q[start:start + n], pool, table, start)
            assert torch.equal(got, whole[start:start + n]), (start, n)


@KERNEL_ONLY
def test_the_blocks_kernel_gives_the_same_floats_on_any_thread_count():
    pool, table = _blocks(1000, 3, 64, 128, seed=1)
    q = _queries(1000, 9, 64, seed=2)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            outs = []
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                outs.append(prompt_attend.causal_blocks(q[300:], pool, table, 300))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@KERNEL_ONLY
def test_the_blocks_kernel_refuses_what_it_cannot_read_within_bounds():
    pool, table = _blocks(300, 2, 32, 128, seed=3)
    q = _queries(300, 6, 32, seed=4)
    with torch.inference_mode():
        outside = table.clone()
        outside[1] = pool.shape[0]
        with pytest.raises(ValueError, match="outside the pool"):
            prompt_attend.causal_blocks(q, pool, outside, 0)
        with pytest.raises(ValueError, match="shorter than the keys"):
            prompt_attend.causal_blocks(q, pool, table[:2], 0)
        for args in ((q, pool.float(), table), (q, pool, table.int()), (q.double(), pool, table),
                     (q.contiguous().transpose(1, 2), pool, table), (q, pool[:, :, :16].contiguous(), table)):
            assert not prompt_attend.blocks_fit(*args)
        with pytest.raises(ValueError, match="does not apply"):
            prompt_attend.causal_blocks(q, pool.float(), table, 0)


def test_kvledger_prompt_attend_0_keeps_torchs_path():
    code = "from kvledger.engine.models import prompt_attend; print(prompt_attend.KERNEL)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVLEDGER_PROMPT_ATTEND": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("start, n", [(0, 300), (250, 50), (299, 1), (0, 1)])
def test_torchs_path_is_the_formula_in_float32(start, n):
    g = torch.Generator().manual_seed(start + n)
    end = start + n
    q = torch.randn(n, HEADS, D, generator=g)
    k, v = torch.randn(end, KV_HEADS, D, generator=g).bfloat16(), torch.randn(end, KV_HEADS, D, generator=g).bfloat16()
    got = prompt_attend.causal(q, k.float(), v.float(), start)
    assert got.dtype == torch.float32 and got.shape == (n, HEADS, D)
    assert _rel(got, _reference(q, k, v, start)) <= 1e-5   # over the bf16 values: what the blocks hold


def test_a_prompts_many_rows_take_mkl_on_an_intel_cpu_unless_told_otherwise():
    """MKL's AVX-512 float32 GEMM is the faster on an Intel CPU, oneDNN's elsewhere (`onednn.py`); MKL capped below
    AVX-512 or on its reference kernels, or `KVLEDGER_MATMUL=onednn`, keeps oneDNN."""
    code = "from kvledger.engine.models import onednn; print(onednn.MKL_ROWS)"
    base = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")}
    runs = {name: subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                                 timeout=120).stdout.strip()
            for name, env in (("default", {}), ("onednn", {"KVLEDGER_MATMUL": "onednn"}),
                              ("mkl-avx2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
                              ("mkl-cbwr", {"MKL_CBWR": "COMPATIBLE"}))}
    with open("/proc/cpuinfo") as f:
        info = f.read()
    mkl_avx512 = "GenuineIntel" in info and " avx512f" in info
    assert runs == {"default": str(mkl_avx512), "onednn": "False", "mkl-avx2": "False", "mkl-cbwr": "False"}
    if not onednn.AVAILABLE:
        return
    linear = onednn.Linear(64, 48, bias=False)
    x = torch.randn(40, 64)
    with torch.inference_mode():
        many = linear(x)
        onednn_rows = torch.ops.mkldnn._linear_pointwise(x, linear.weight, None, "none", [], "")
        assert torch.equal(many, torch.nn.functional.linear(x, linear.weight) if onednn.MKL_ROWS else onednn_rows)
