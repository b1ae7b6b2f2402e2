"""A prompt chunk's attention (`prompt_attend`): kvledger's float32 kernel over the blocks (the formula, the same
floats for a query in any chunk and on any thread count, what it refuses); torch's path against float64, in
float32 and in bf16; the checks that decide whether bf16 is exact on this CPU (they must be able to say no);
`onednn.Linear`'s many-row path."""

import os
import subprocess
import sys

import pytest
import torch

from kvledger.engine.models import gemv, onednn, prompt_attend

HEADS, KV_HEADS, D = 6, 2, 32


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal grouped-query attention in float64: query head i reads KV head i // group."""
    end, group = start + q.shape[0], q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k[:end].double().repeat_interleave(group, 1), v[:end].double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) / q.shape[2] ** 0.5
    s = s.masked_fill(torch.arange(end)[None, :] > torch.arange(start, end)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vd)


def _padded(x: torch.Tensor, end: int) -> torch.Tensor:
    out = torch.zeros(prompt_attend.padded_length(end), *x.shape[1:], dtype=x.dtype)
    out[:end] = x[:end]
    return out


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
def test_causal_is_the_formula_in_float32_and_within_bf16_rounding_in_bf16(start, n):
    g = torch.Generator().manual_seed(start + n)
    end = start + n
    q = torch.randn(n, HEADS, D, generator=g)
    k, v = torch.randn(end, KV_HEADS, D, generator=g).bfloat16(), torch.randn(end, KV_HEADS, D, generator=g).bfloat16()
    want = _reference(q, k, v, start)   # over the bf16 values: what the blocks hold
    got32 = prompt_attend.causal(q, k.float(), v.float(), start)
    assert got32.dtype == torch.float32 and got32.shape == (n, HEADS, D)
    assert _rel(got32, want) <= 1e-5
    got16 = prompt_attend.causal(q, _padded(k, end), _padded(v, end), start)   # keys in whole tiles, zeros after
    assert got16.dtype == torch.float32
    assert _rel(got16, want) <= 1e-2   # Q, the probabilities and the output rounded to bf16: 2⁻⁹ each


def test_where_the_check_passes_chunks_of_lengths_it_did_not_try_are_exact_too():
    """The check tries a few chunk lengths; the property it stands for is every length's."""
    if not prompt_attend.rows_invariant(HEADS, KV_HEADS, D, 1024, torch.bfloat16):
        pytest.skip("torch's bf16 attention is not row-invariant on this CPU: prompts attend in float32 here")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1000, HEADS, D, generator=g) * 3
    k = (torch.randn(1000, KV_HEADS, D, generator=g) * 3).bfloat16()
    v = torch.randn(1000, KV_HEADS, D, generator=g).bfloat16()
    whole = prompt_attend.causal(q, _padded(k, 1000), _padded(v, 1000), 0)
    for end, n in ((1000, 5), (1000, 130), (777, 3), (513, 512), (200, 199)):
        got = prompt_attend.causal(q[end - n:end], _padded(k, end), _padded(v, end), end - n)
        assert torch.equal(got, whole[end - n:end]), (end, n)


def test_the_attention_check_says_no_to_a_kernel_that_rounds_one_query_otherwise(monkeypatch):
    exact = prompt_attend.causal

    def one_query_apart(q, k, v, start):
        out = exact(q, k, v, start)
        return out if q.shape[0] > 1 else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(prompt_attend, "causal", one_query_apart)
    assert not prompt_attend.rows_invariant(HEADS, KV_HEADS, D, 600, torch.bfloat16)


def test_the_attention_check_says_no_where_the_kernel_fails(monkeypatch):
    def fails(*_):
        raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")

    monkeypatch.setattr(prompt_attend, "causal", fails)
    assert not prompt_attend.rows_invariant(HEADS, KV_HEADS, D, 600, torch.bfloat16)


class _ByRowCount(torch.nn.Module):
    """A product whose rounding depends on how many rows it has: float64 for a few rows, float32 for many."""

    in_features = 64

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor, steps: torch.Tensor | None = None) -> torch.Tensor:
        return (x.double() @ self.weight.double().T).float() if x.shape[0] < 8 else x @ self.weight.T


def test_the_matmul_check_says_no_to_a_product_that_rounds_by_row_count():
    assert not onednn.rows_invariant([_ByRowCount()], 300)


def test_a_prompts_rows_take_onednn_however_few_and_its_step_rows_the_few_rows_kernel(monkeypatch):
    """`onednn.Linear`: without `steps` (a decode step's rows) the few-rows kernel; with them, oneDNN for every
    row, then the step rows again in the few-rows kernel, so each row rounds as its kind does elsewhere."""
    if not (gemv.AVAILABLE and onednn.AVAILABLE):
        pytest.skip("needs both kvledger's gemv kernel and oneDNN (this CPU or build lacks one)")
    calls = []
    kernel = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    linear = onednn.Linear(64, 48, bias=False)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        steps_only, prompt = linear(x), linear(x, onednn.NO_STEPS)
        assert calls == [3]
        one = linear(x[:1], onednn.NO_STEPS)
        mixed = linear(x, torch.tensor([2]))
        assert calls == [3, 1]
        onednn_rows = linear._onednn(x)
    assert torch.equal(prompt, onednn_rows) and torch.equal(one, linear._onednn(x[:1].expand(2, -1))[:1])
    assert torch.equal(mixed[:2], onednn_rows[:2]) and torch.equal(mixed[2], steps_only[2])
    assert _rel(prompt, steps_only.double()) <= 1e-6


def test_a_prompts_many_rows_take_mkl_on_an_intel_cpu_unless_told_otherwise():
    """MKL's AVX-512 float32 GEMM is the faster on an Intel CPU, oneDNN's elsewhere (`onednn.py`); MKL capped below
    AVX-512 or on its reference kernels, or `KVLEDGER_MATMUL=onednn`, keeps oneDNN. A forward with steps (bf16
    prompts) takes oneDNN whichever the CPU."""
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
        many, with_steps = linear(x), linear(x, onednn.NO_STEPS)
        assert torch.equal(many, torch.nn.functional.linear(x, linear.weight) if onednn.MKL_ROWS else linear._onednn(x))
        assert torch.equal(with_steps, linear._onednn(x))
