"""decode_mirror.py: a decode step reads K and V from its sequence's mirror, equal bit for bit to what the blocks
give (`PagedKV.gather_heads`), at every step, across block boundaries and growth, and never for another
sequence, another position or past its budget; and a Llama decoding through mirrors gives the logits it gives
through the blocks."""

import pytest
import torch

from kvledger.engine.models.base import Chunk, PagedKV
from kvledger.engine.models.llama import Llama, LlamaConfig, llama_spec
from kvledger.engine.sequence import new_uid

B, KV_HEADS, D = 128, 3, 64
TABLE = torch.tensor([7, 2, 11, 4, 9, 1, 5, 3])   # 8 blocks out of order: 1,024 positions


def pool(mirror_share: float = 1.0) -> PagedKV:
    cache = PagedKV(B, KV_HEADS, D, torch.bfloat16, mirror_share)
    cache.allocate(12, 0, torch.device("cpu"))
    return cache


def write_one(cache: PagedKV, position: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cache.write(TABLE, position, torch.randn(1, KV_HEADS, D, generator=g), torch.randn(1, KV_HEADS, D, generator=g))


def decode(cache: PagedKV, seq: int, start: int, steps: int, seed: int = 0) -> None:
    """`steps` decode steps of `seq` from `start`: write the position, read it back both ways, compare."""
    for position in range(start, start + steps):
        write_one(cache, position, seed + position)
        k, v = cache.decode_heads(seq, TABLE, position, torch.float32)
        want_k, want_v = cache.gather_heads(TABLE, position + 1, torch.float32)
        assert torch.equal(k, want_k) and torch.equal(v, want_v), position


def test_each_step_reads_what_the_blocks_hold_across_block_boundaries_and_growth():
    cache = pool()
    torch.manual_seed(0)
    cache.write(TABLE, 0, torch.randn(100, KV_HEADS, D), torch.randn(100, KV_HEADS, D))
    decode(cache, seq=1, start=100, steps=500)   # crosses 4 block boundaries; the entry grows twice
    entry = cache.mirror.entries[1]
    assert entry.length == 600 and entry.kv.shape[2] >= 600
    assert cache.mirror.used_bytes == entry.nbytes
    write_one(cache, 600, 0)
    k, _ = cache.decode_heads(1, TABLE, 600, torch.float32)
    assert k.untyped_storage().data_ptr() == entry.kv.untyped_storage().data_ptr()   # read in place, not gathered


def test_a_step_at_another_position_rebuilds_from_the_blocks():
    """Only a step at the entry's length extends it: a skipped position, or a position rewritten below it (a
    sequence computing again), reads the blocks."""
    cache = pool()
    decode(cache, seq=1, start=0, steps=40)
    decode(cache, seq=1, start=45, steps=3, seed=1000)       # 40..44 skipped: rebuilt at 45
    assert cache.mirror.entries[1].length == 48
    decode(cache, seq=1, start=10, steps=5, seed=2000)       # 10..14 rewritten with other values
    assert cache.mirror.entries[1].length == 15


def test_sequences_keep_their_own_entries_and_retain_drops_the_absent():
    cache = pool()
    decode(cache, seq=1, start=0, steps=20)
    decode(cache, seq=2, start=20, steps=20, seed=500)   # overwrites 20..39 of the shared table: seq 2's values
    assert set(cache.mirror.entries) == {1, 2}
    decode(cache, seq=1, start=20, steps=1, seed=900)    # seq 1's entry ends at 20: extended, reads seq 2's 0..19
    cache.mirror.retain([2])
    assert set(cache.mirror.entries) == {2}
    cache.mirror.retain([])
    assert cache.mirror.entries == {} and cache.mirror.used_bytes == 0


def test_no_entry_past_the_budget_or_for_a_sequence_without_an_id():
    cache = pool(mirror_share=0.01)   # 12 blocks' bytes × 0.01: less than one entry
    decode(cache, seq=1, start=0, steps=10)
    assert cache.mirror.entries == {}
    cache = pool()
    decode(cache, seq=-1, start=0, steps=10)
    assert cache.mirror.entries == {}
    cache = PagedKV(B, KV_HEADS, D, torch.bfloat16)   # the default: no mirror (Gemma 3's full layers)
    cache.allocate(12, 0, torch.device("cpu"))
    decode(cache, seq=1, start=0, steps=10)
    assert cache.mirror.entries == {}


def test_new_uids_are_never_reused():
    uids = [new_uid() for _ in range(1000)]
    assert len(set(uids)) == 1000


@pytest.fixture(scope="module")
def tiny_llama():
    """A Llama of SmolLM2's head geometry at toy size, random weights."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden=576, intermediate=256, layers=2, heads=9, kv_heads=3, vocab=300, rope_theta=1e4,
                      rms_eps=1e-5, max_positions=4096, tie_embeddings=True, eos_token_ids=())
    model = Llama(cfg, llama_spec("toy-llama", 2, 3, 64, weights="random")).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    for cache in model.caches:
        cache.allocate(32, 0, torch.device("cpu"))
    return model


def test_a_llama_decoding_through_mirrors_gives_the_logits_of_the_blocks(tiny_llama):
    """Two sequences prefill, then decode together for 150 steps (past a block boundary) once with ids (mirrored)
    and once without; the second run rewrites the same positions with the same tokens, so every step's logits
    must be equal bit for bit."""
    model = tiny_llama
    tables = [torch.arange(1, 9), torch.arange(9, 17)]
    prompts = [torch.randint(0, 300, (200,)), torch.randint(0, 300, (90,))]
    steps = torch.randint(0, 300, (150, 2))
    with torch.inference_mode():
        model([Chunk(p, 0, t) for p, t in zip(prompts, tables)])
        runs = {}
        for ids in ((-1, -1), (new_uid(), new_uid())):
            runs[ids[0]] = [model([Chunk(steps[i, j:j + 1], len(prompts[j]) + i, tables[j], seq=ids[j])
                                   for j in range(2)]) for i in range(len(steps))]
            if ids[0] >= 0:   # the mirrors were read: every step but each sequence's first, in every layer
                assert set(model.caches[0].mirror.entries) == set(ids)
                assert [c.mirror.reads_in_place for c in model.caches] == [2 * (len(steps) - 1)] * 2
        gathered, mirrored = runs[-1], next(v for k, v in runs.items() if k >= 0)
        assert all(torch.equal(a, b) for a, b in zip(gathered, mirrored))
        model([Chunk(prompts[0][:5], 0, tables[0])])   # a forward without them: their entries go
        assert model.caches[0].mirror.entries == {}
