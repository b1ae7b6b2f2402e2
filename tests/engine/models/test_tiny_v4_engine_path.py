"""tiny-v4 through the engine's model interface (`base.Model`): device caches, chunks, swap-in order."""

import pytest
import torch

from kvledger.core.hit import decide_hit, prefill_store_positions
from kvledger.engine.models.base import Chunk
from kvledger.engine.models.registry import resolve
from tests.engine.models.tiny_v4_paths import ledger_blocks, prefill_cold, prefill_hit
from tests.engine.models.tiny_v4_helpers import prompt, tiny_v4  # noqa: F401

L = 600


@pytest.fixture(scope="module")
def engine_model(tiny_v4):  # noqa: F811
    tiny_v4.allocate(num_blocks=32, num_slots=3)
    return tiny_v4


def table(first: int, n: int = 8) -> torch.Tensor:
    return torch.arange(first, first + n)


def ledger_block(model, block: int) -> bytes:
    """One block as the block ledger holds it: every layer's block view, in layer order."""
    return b"".join(bytes(c.block_view(block).cpu().numpy()) for c in model.caches if c.block_bytes)


def put_block(model, block: int, data: bytes) -> None:
    off = 0
    for cache in model.caches:
        if cache.block_bytes:
            part = torch.frombuffer(bytearray(data[off:off + cache.block_bytes]), dtype=torch.uint8)
            cache.block_view(block).copy_(part)
            off += cache.block_bytes


def forward(model, tokens, start, blocks, slot, **kw):
    chunk = Chunk(tokens, start, blocks, slot=slot, prompt_len=L, **kw)
    order = []
    logits = model([chunk], before_layer=order.append)
    assert order == list(range(8)), "before_layer runs once per layer, in order"
    return logits[0]


def test_loader_and_geometry(engine_model):
    assert resolve("tiny-v4").load().spec.name == "tiny-v4"
    assert engine_model.layer_block_bytes() == (0, 0, 6144, 128, 6144, 128, 6144, 128)
    assert engine_model.snapshot_layers() == [0, 1, 2, 3]


def test_cold_hit_and_decode_through_the_caches(engine_model):
    model, tokens, spec = engine_model, prompt(L, seed=40), engine_model.spec
    state, reference = prefill_cold(model, tokens)
    forward(model, tokens[:256], 0, table(1), 0)
    cold = forward(model, tokens[256:], 256, table(1), 0)
    assert torch.equal(cold, reference[-1])
    blocks = [ledger_block(model, b) for b in table(1)[:4].tolist()]
    assert blocks == ledger_blocks(model, state, 4), "device blocks hold the ledger layout"
    snap = torch.zeros(spec.state_size_to_disk(), dtype=torch.uint8)
    model.export_window(0, 384, snap)

    for b, data in zip(table(11)[:3].tolist(), blocks):  # another slot, other device blocks
        put_block(model, b, data)
    model.import_window(1, 384, snap)
    hit = forward(model, tokens[384:], 384, table(11), 1)
    assert torch.equal(hit, cold)
    for _ in range(3):
        token = torch.tensor([int(cold.argmax())])
        cold = forward(model, token, L + _, table(1), 0)
        hit = forward(model, token, L + _, table(11), 1)
        assert torch.equal(hit, cold), "decode after a hit"


@pytest.mark.parametrize("replay", [False, True])
def test_fallback_and_replay_through_the_caches(engine_model, replay):
    model, tokens = engine_model, prompt(L, seed=41)
    state, _ = prefill_cold(model, tokens)
    blocks = ledger_blocks(model, state, 4)
    decision = decide_hit(L, 4, set(), model.spec, replay=replay)
    _, reference = prefill_hit(model, tokens, decision, blocks)
    for b, data in zip(table(21)[:4].tolist(), blocks):
        put_block(model, b, data)
    s = decision.recompute_from
    keep = decision.block_hit_tokens if replay else 0
    logits = forward(model, tokens[s:], s, table(21), 2, keep_blocks_until=keep, truncate_from=s)
    assert torch.equal(logits, reference[-1])
    if replay:  # the replayed block [s, L1) is reused as it is, never written
        n = decision.block_hit_tokens // 128
        assert [ledger_block(model, b) for b in table(21)[:n].tolist()] == blocks[:n]
    snap = torch.zeros(model.spec.state_size_to_disk(), dtype=torch.uint8)
    for position in prefill_store_positions(L, model.spec):  # rule 4 after a truncated prefill
        model.export_window(2, position, snap)
        missing = max(s - (position - 134), 0)  # slack slots before s: zeros; the last 127 are held
        assert not snap[:missing * 128].any() and snap[missing * 128:134 * 128].any()
