"""The block-store contract, one suite for every backend (file, Redis, cluster): see the `store` fixture."""

from __future__ import annotations

import numpy as np
import pytest

from kvledger.store.ledger import BlockLedger

from .conftest import BLOCK, SPEC, block_of

NAMESPACES = ["tenant-a", "", "x" * (1 << 16), "x" * (1 << 17) + "y", "\ud800 lone", "日本語\U0001F600", "\x00"]


def _tokens(n_blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * SPEC.block_size, dtype=np.uint32)


def test_tenants_share_no_block_above_chain_keys(store):
    """A cross-tenant read is what a ledger ignoring the namespace would serve: the same tokens, another tenant."""
    led = BlockLedger(store)
    tokens = _tokens(6)
    keys_a, n = led.match_tokens(tokens, SPEC, namespace="tenant-a")
    assert n == 0
    assert led.put_chain(keys_a, [block_of(k) for k in keys_a], namespace="tenant-a").written == 6
    assert led.match_tokens(tokens, SPEC, namespace="tenant-a")[1] == 6
    keys_b, n_b = led.match_tokens(tokens, SPEC, namespace="tenant-b")
    assert n_b == 0 and not set(keys_a) & set(keys_b)
    assert led.match_tokens(tokens, SPEC)[1] == 0  # nor the default namespace
    assert led.read_prefix(keys_b, [bytearray(BLOCK) for _ in keys_b]) == 0


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda ns: f"{len(ns)}ch")
def test_any_namespace_gets_keys_and_puts_never_raise(store, namespace):
    led = BlockLedger(store)
    tokens = _tokens(3, seed=7)
    keys, n = led.match_tokens(tokens, SPEC, namespace=namespace)
    assert len(keys) == 3 and n == 0
    assert led.put_chain(keys, [block_of(k) for k in keys], namespace=namespace) == (3, 0, 0)
    assert led.match_tokens(tokens, SPEC, namespace=namespace)[1] == 3
    assert led.match_tokens(tokens, SPEC, namespace=namespace + "!")[1] == 0
    bufs = [bytearray(BLOCK) for _ in keys]
    assert led.get_into(keys, bufs) == [BLOCK] * 3 and [bytes(b) for b in bufs] == [block_of(k) for k in keys]
    st = led.stats()
    assert st.blocks == 3 and sum(st.per_namespace.values()) == 3
    (recorded,) = st.per_namespace
    assert recorded == namespace if len(namespace) < 1000 else recorded.startswith(namespace[:100])
