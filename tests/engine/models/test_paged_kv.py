"""PagedKV's two reads of a sequence's K and V, and the one-query attention that reads it heads first (SmolLM2's
geometry: 3 KV heads of 64, 9 query heads, blocks of 128 scattered over the pool)."""

import pytest
import torch
import torch.nn.functional as F

from kvledger.engine.models.base import PagedKV
from kvledger.engine.models.llama import Attention, LlamaConfig

B, KV_HEADS, HEADS, D = 128, 3, 9, 64


@pytest.fixture
def filled():
    """A pool of 12 blocks; a 700-token sequence (6 blocks, the last one partial) on blocks out of order."""
    torch.manual_seed(0)
    cache = PagedKV(B, KV_HEADS, D, torch.bfloat16)
    cache.allocate(12, 0, torch.device("cpu"))
    table = torch.tensor([7, 2, 11, 4, 9, 1])
    cache.write(table, 0, torch.randn(700, KV_HEADS, D), torch.randn(700, KV_HEADS, D))
    return cache, table


@pytest.mark.parametrize("length", [1, 128, 300, 700])
def test_gather_heads_is_gather_heads_first(filled, length):
    cache, table = filled
    k, v = cache.gather(table, length, torch.float32)
    kh, vh = cache.gather_heads(table, length, torch.float32)
    assert kh.shape == (KV_HEADS, length, D)
    assert torch.equal(kh, k.transpose(0, 1)) and torch.equal(vh, v.transpose(0, 1))


def test_one_query_attends_as_grouped_query_attention_does(filled):
    """Query head i reads KV head i // 3, as SDPA's `enable_gqa` (which repeats each KV head 3 times) does."""
    cache, table = filled
    cfg = LlamaConfig(hidden=HEADS * D, intermediate=1, layers=1, heads=HEADS, kv_heads=KV_HEADS, vocab=1,
                      rope_theta=1e4, rms_eps=1e-5, max_positions=1024, tie_embeddings=True, eos_token_ids=())
    attn = Attention(cfg)
    q = torch.randn(1, HEADS, D)

    class One:   # the chunk fields the attention reads: no sequence id, so the blocks are read
        block_table, start, seq = table, 699, -1

    got = attn._attend_one(q, One, cache)
    k, v = cache.gather(table, 700, torch.float32)
    want = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                          v.transpose(0, 1).unsqueeze(0), enable_gqa=True).squeeze(0).transpose(0, 1)
    assert got.shape == want.shape == (1, HEADS, D)
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def test_a_one_position_write_lands_as_a_many_position_write_does(filled):
    """A decode step writes its one slot through views; the bytes are those of the index-tensor write of prefills."""
    cache, table = filled
    other = PagedKV(B, KV_HEADS, D, torch.bfloat16)
    other.allocate(12, 0, torch.device("cpu"))
    k, v = torch.randn(2, KV_HEADS, D), torch.randn(2, KV_HEADS, D)
    for pos in (700, 766):   # the partial block's next slots, and its last two
        other.kv.copy_(cache.kv)
        other.write(table, pos, k, v)        # two positions: index tensors
        cache.write(table, pos, k[:1], v[:1])
        cache.write(table, pos + 1, k[1:], v[1:])
        assert torch.equal(cache.kv, other.kv)


def test_a_one_position_write_through_the_null_block_is_refused(filled):
    cache, table = filled
    with pytest.raises(AssertionError, match="null block"):
        cache.write(torch.tensor([7, 0]), 130, torch.randn(1, KV_HEADS, D), torch.randn(1, KV_HEADS, D))
