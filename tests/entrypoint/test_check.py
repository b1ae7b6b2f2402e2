"""check_prompt: CHECK from metadata alone turns into the rule-3 decision."""

from dataclasses import replace

import numpy as np

from kvledger.core import HitKind, ModelSpec, chain_keys
from kvledger.entrypoint.check import check_prompt
from kvledger.state.ledger import StateLedger
from kvledger.store.ledger import BlockLedger


def _store(ledger: BlockLedger, keys: list[bytes], spec: ModelSpec) -> None:
    blocks = [bytes([i % 251]) * spec.block_bytes() for i in range(len(keys))]
    ledger.put_chain(keys, blocks)


def test_full_attention_hit_is_capped(tmp_path):
    spec = ModelSpec.preset("smollm2-135m")
    tokens = np.arange(1000, dtype=np.uint32) % 700
    with BlockLedger.open(path=tmp_path, fsync=False) as ledger:
        keys, d = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=None)
        assert keys == chain_keys(tokens, spec) and d.kind is HitKind.MISS and d.hit_tokens == 0
        _store(ledger, keys, spec)
        _, d = check_prompt(list(tokens), spec, block_ledger=ledger, state_ledger=None)
        assert d.kind is HitKind.FULL and d.hit_tokens == 896  # ⌊999/128⌋·128
        _, other = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=None, namespace="b")
        assert other.hit_tokens == 0


def test_snapshot_at_l1_decides(tmp_path):
    """tiny-v4 resumes exactly (rule 3′): without a snapshot at L1 = 1024, the latest one below it, found by
    the same CHECK (one batched lookup of every boundary), or a miss; the fallback only as V4 decides."""
    spec = ModelSpec.preset("tiny-v4")
    v4_rule = replace(spec, approximate_fallback=True)
    tokens = np.arange(1200, dtype=np.uint32)
    states = StateLedger(spec, token="t", serve=False, heartbeat=False, capacity_bytes=1 << 22).start()
    try:
        with BlockLedger.open(path=tmp_path, fsync=False) as ledger:
            keys = chain_keys(tokens, spec)
            _store(ledger, keys, spec)
            _, d = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=states)
            assert d.kind is HitKind.MISS and d.hit_tokens == 0 and d.cap == 1024
            _, d = check_prompt(tokens, v4_rule, block_ledger=ledger, state_ledger=states)
            assert d.kind is HitKind.FALLBACK and d.block_hit_tokens == 1024 and d.hit_tokens == 896
            _, d = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=states, replay=True)
            assert d.kind is HitKind.REPLAY and d.hit_tokens == 1024 and d.truncate_from == 896
            states.put(keys[2], 384, bytes(spec.state_size_to_disk()))
            states.put(keys[6], 896, bytes(spec.state_size_to_disk()))
            _, d = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=states)
            assert d.kind is HitKind.SNAPSHOT and d.hit_tokens == d.recompute_from == 896 and d.exact
            # rule 3: only the snapshot at L1 counts for a model that falls back
            assert check_prompt(tokens, v4_rule, block_ledger=ledger, state_ledger=states)[1].kind is HitKind.FALLBACK
            states.put(keys[7], 1024, bytes(spec.state_size_to_disk()))
            _, d = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=states)
            assert d.kind is HitKind.SNAPSHOT and d.hit_tokens == 1024 and d.recompute_from == 1024
    finally:
        states.close()


def test_a_later_leg_hashes_only_its_new_blocks(tmp_path, monkeypatch):
    """A continuation leg (prompt + output) keeps the keys of the blocks it had: the same keys, and only
    the output's new blocks are hashed."""
    import kvledger.core.keys as keys_module

    spec = ModelSpec.preset("smollm2-135m")
    tokens = np.arange(1300, dtype=np.uint32) % 700
    hashed: list[int] = []
    real = keys_module.extend_chain
    monkeypatch.setattr(keys_module, "extend_chain", lambda parent, t, b: hashed.append(len(t)) or real(parent, t, b))
    with BlockLedger.open(path=tmp_path, fsync=False) as ledger:
        first, _ = check_prompt(tokens[:1000], spec, block_ledger=ledger, state_ledger=None)
        keys, d = check_prompt(tokens, spec, block_ledger=ledger, state_ledger=None, known_keys=first)
    assert hashed == [7 * 128, 3 * 128]   # the whole blocks of each leg's new tokens
    assert keys == chain_keys(tokens, spec) and len(first) == 7 and len(keys) == 10
