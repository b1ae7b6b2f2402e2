"""tiny-v4's geometry and byte layouts agree with ModelSpec.preset("tiny-v4")."""

import torch

from kvledger.core.spec import LayerKind, ModelSpec
from kvledger.engine.models.tiny_v4 import TinyV4
from kvledger.engine.models.tiny_v4_state import (
    block_bytes,
    block_layout,
    load_block,
    load_snapshot,
    snapshot_bytes,
)
from tests.engine.models.tiny_v4_helpers import prompt, tiny_v4  # noqa: F401


def test_model_has_the_spec_geometry(tiny_v4):  # noqa: F811
    spec = ModelSpec.preset("tiny-v4")
    assert tiny_v4.spec == spec
    kinds = [layer.attn.kind for layer in tiny_v4.layers]
    assert kinds == list(spec.layers) == [LayerKind.SWA] * 2 + [LayerKind.CSA, LayerKind.HCA] * 3
    assert tiny_v4.cfg.latent_dim * 2 == spec.swa_bytes_per_token == 128
    assert tiny_v4.encoder_layers == spec.swa_stored_layers == 4
    assert spec.window == tiny_v4.cfg.window == 128


def test_block_layout_tiles_the_spec_block():
    spec = ModelSpec.preset("tiny-v4")
    layout = block_layout(spec, 64, 32)
    assert [p.layer for p in layout] == [2, 3, 4, 5, 6, 7]
    assert layout[0].offset == 0 and layout[-1].end == spec.block_bytes() == 128 * (99 + 48)
    for a, b in zip(layout, layout[1:]):
        assert a.end == b.offset
    assert sum(p.main_bytes for p in layout) == 128 * spec.kv_bytes_per_token
    assert sum(p.index_bytes for p in layout) == 128 * spec.indexer_bytes_per_token


def test_bytes_have_the_spec_sizes_and_round_trip(tiny_v4):  # noqa: F811
    spec, tokens = tiny_v4.spec, prompt(300, seed=1)
    state = tiny_v4.new_state(len(tokens))
    tiny_v4.step(state, tokens)
    blocks = [block_bytes(state, tiny_v4.layout, b) for b in range(2)]
    assert all(len(data) == spec.block_bytes() for data in blocks)
    snap = snapshot_bytes(state, spec, 256)
    assert len(snap) == spec.state_size_to_disk() == 4 * 134 * 128

    again = tiny_v4.new_state(1000, pos=256)  # prompt length only sets the anchor
    for b, data in enumerate(blocks):
        load_block(again, tiny_v4.layout, b, data)
    load_snapshot(again, spec, snap)
    for layer in (2, 3, 4, 5, 6, 7):
        assert torch.equal(again.entries[layer], state.entries[layer][:again.entries[layer].shape[0]])
    for layer in (2, 4, 6):
        assert torch.equal(again.index_keys[layer], state.index_keys[layer][:64])
    for layer in range(4):
        assert (again.windows[layer].start, again.windows[layer].end) == (256 - 134, 256)
        assert torch.equal(again.windows[layer].latents, state.windows[layer].rows(122, 256))
    assert all(again.windows[layer].end == again.windows[layer].start for layer in range(4, 8)), \
        "consumer windows are never stored"


def test_snapshot_before_position_134_is_zero_padded(tiny_v4):  # noqa: F811
    spec = tiny_v4.spec
    state = tiny_v4.new_state(200)
    tiny_v4.step(state, prompt(200, seed=2))
    snap = snapshot_bytes(state, spec, 128)
    per_layer = len(snap) // 4
    assert snap[:6 * 128] == bytes(6 * 128) and snap[per_layer:per_layer + 6 * 128] == bytes(6 * 128)
    again = tiny_v4.new_state(1000, pos=128)
    load_snapshot(again, spec, snap)
    assert again.windows[0].start == 0 and torch.equal(again.windows[0].latents, state.windows[0].rows(0, 128))


def test_weights_come_from_the_seed():
    a, b = TinyV4(), TinyV4()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = TinyV4(type(a.cfg)(seed=1))
    assert not torch.equal(a.embed, c.embed)
