import pytest

from kvledger import LayerKind, ModelSpec


def test_v4_flash_published_numbers():
    s = ModelSpec.preset("deepseek-v4.1-flash")
    assert (s.block_size, s.window, s.backtrack) == (128, 128, 6)
    assert s.block_bytes() == 128 * 890 == 113_920
    assert s.state_size_to_disk() == 20 * 134 * 528 == 1_415_040
    assert s.inference_ring() == 134
    assert s.kvstore_ring(extra_state=True) == 134 + 128 + 134 == 396
    assert s.kvstore_ring(extra_state=False) == 134
    assert s.reserve_tokens == 134
    assert s.max_copy_overshoot == 5


def test_v4_flash_layer_layout():
    s = ModelSpec.preset("deepseek-v4.1-flash")
    assert s.n_layers == 43
    assert s.layers[:2] == (LayerKind.SWA, LayerKind.SWA)
    rest = s.layers[2:]
    assert all(k is (LayerKind.CSA if i % 2 == 0 else LayerKind.HCA) for i, k in enumerate(rest))
    assert s.layer_counts() == {"swa": 2, "csa": 21, "hca": 20}
    assert (s.csa_ratio, s.hca_ratio) == (4, 128)


def test_tiny_v4_is_v4_at_toy_size():
    t, v = ModelSpec.preset("tiny-v4"), ModelSpec.preset("deepseek-v4.1-flash")
    for attr in ("block_size", "window", "backtrack", "csa_ratio", "hca_ratio", "prefill_store_extra", "yoco_keep"):
        assert getattr(t, attr) == getattr(v, attr), attr
    assert t.layers[:2] == v.layers[:2] and set(t.layers) == set(v.layers)
    assert t.inference_ring() == 134 and t.kvstore_ring() == 396
    assert t.block_bytes() == 128 * (99 + 48)
    assert t.state_size_to_disk() == 4 * 134 * 128
    assert t.block_bytes() < v.block_bytes()


def test_smollm2_is_full_attention():
    s = ModelSpec.preset("smollm2-135m")
    assert s.n_layers == 30 and set(s.layers) == {LayerKind.FULL}
    assert not s.has_swa and s.window is None
    assert s.reserve_tokens == 1
    assert s.inference_ring() == 0 and s.state_size_to_disk() == 0
    assert s.block_bytes() == 128 * 30 * 2 * 3 * 64 * 2


def test_gemma3_270m_is_designs_table():
    """DESIGN.md, "Rules 3–4 for other hybrid models", the Gemma 3 column."""
    s = ModelSpec.preset("gemma3-270m")
    assert (s.block_size, s.window, s.backtrack) == (128, 512, 6)
    assert s.n_layers == 18 and [i for i, k in enumerate(s.layers) if k is LayerKind.FULL] == [5, 11, 17]
    assert s.layer_counts() == {"swa": 15, "full": 3} and s.windowed_layers == 15
    assert s.swa_stored_layers == 15                  # every window in the snapshot: nothing dropped
    assert s.reserve_tokens == 1                      # rule 3′: R = 1
    assert s.swa_bytes_per_token == 2 * 256 * 2 == 1_024
    assert s.block_bytes() == 3 * 1_024 * 128 == 393_216
    assert s.inference_ring() == 518 and s.kvstore_ring() == 518 + 128 == 646
    assert s.state_size_to_disk() == 15 * (512 + 6) * 1_024 == 7_956_480   # ≈ 7.6 MiB, ≈ 20 blocks
    assert not s.approximate_fallback and s.has_swa
    assert s.fingerprint() not in {ModelSpec.preset(n).fingerprint() for n in ModelSpec.presets() if n != s.name}


def test_reserve_tokens_follow_from_what_a_snapshot_drops():
    """R = W + K only where a snapshot drops windows (V4's YoCo consumers); a model keeping them all has R = 1."""
    v4 = ModelSpec.preset("deepseek-v4.1-flash")
    assert v4.windowed_layers == 43 > v4.swa_stored_layers and v4.reserve_tokens == 134
    tiny = ModelSpec.preset("tiny-v4")
    assert tiny.windowed_layers == 8 > tiny.swa_stored_layers and tiny.reserve_tokens == 134
    keeps_all = ModelSpec(**{**_fields(tiny), "swa_stored_layers": 8})
    assert keeps_all.reserve_tokens == 1


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match="known: deepseek-v4.1-flash"):
        ModelSpec.preset("gpt-5")


def test_fingerprints_differ_and_are_stable():
    prints = {ModelSpec.preset(n).fingerprint() for n in ModelSpec.presets()}
    assert len(prints) == len(ModelSpec.presets())
    assert ModelSpec.preset("tiny-v4").fingerprint() == ModelSpec.preset("tiny-v4").fingerprint()


def test_invalid_specs_are_refused():
    base = ModelSpec.preset("tiny-v4")
    with pytest.raises(AssertionError):
        ModelSpec(**{**_fields(base), "block_size": 100})  # not a multiple of the HCA ratio
    with pytest.raises(AssertionError):
        ModelSpec(**{**_fields(base), "window": None})  # windowed layers need a window


def _fields(s: ModelSpec) -> dict:
    return {f: getattr(s, f) for f in s.__dataclass_fields__}


def test_all_layers_bytes_per_token_counts_every_layers_kv_the_windowed_ones_too():
    """The baseline the state ledger is measured against: a store that keeps every layer's K and V per token."""
    smollm2, gemma3 = ModelSpec.preset("smollm2-135m"), ModelSpec.preset("gemma3-270m")
    assert smollm2.all_layers_bytes_per_token() == smollm2.kv_bytes_per_token   # no windowed layer
    assert gemma3.all_layers_bytes_per_token() == 18 * 2 * 256 * 2 > gemma3.kv_bytes_per_token   # K, V, bf16
