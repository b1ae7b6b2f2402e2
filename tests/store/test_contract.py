"""The block-store contract, one suite for every backend (file, Redis, cluster): see the `store` fixture."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import BLOCK, SPEC, block_of, chain, root

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


def test_roundtrip_idempotent_and_check_stops_at_the_first_absent_block(store):
    led = BlockLedger(store)
    keys, blocks = chain(40)
    assert led.match(keys) == 0 and led.exists(keys[:2]) == [False, False]
    assert led.put_chain(keys[:30], blocks[:30]) == (30, 0, 0)
    assert led.put_chain(keys, blocks) == (10, 30, 0)  # only the missing tail is written
    assert led.match(keys) == 40
    bufs = [bytearray(BLOCK + 100) for _ in keys]  # a buffer may be larger than its block
    assert led.get_into(keys, bufs) == [BLOCK] * 40
    assert [bytes(b[:BLOCK]) for b in bufs] == blocks
    other, _ = chain(5, seed=9)
    assert led.match(other) == 0
    assert led.match(keys[:3] + other) == 3
    assert led.exists(keys[38:] + other[:1]) == [True, True, False]
    assert led.get_into(other[:2] + keys[:1], [bytearray(BLOCK) for _ in range(3)]) == [-1, -1, BLOCK]


def test_a_block_read_into_parts_fills_them_in_order(store):
    """A destination may be a tuple of parts (the engine's layers: `backend.Dest`): the block's bytes fill them one
    after another, with parts of unequal size, a larger last one, and bytes left over untouched."""
    led = BlockLedger(store)
    keys, blocks = chain(3, seed=5)
    assert led.put_chain(keys, blocks) == (3, 0, 0)
    cuts = (100, 1000, BLOCK - 1100)
    dests = [tuple(bytearray(n) for n in cuts[:2]) + (bytearray(cuts[2] + 7),) for _ in keys]
    assert led.get_into(keys, dests) == [BLOCK] * 3
    assert [b"".join(bytes(p) for p in d)[:BLOCK] for d in dests] == blocks
    assert all(bytes(d[2][-7:]) == bytes(7) for d in dests)
    with pytest.raises(ValueError):
        led.get_into(keys[:1], [(bytearray(10), bytearray(BLOCK - 11))])


def test_a_read_part_by_part_gives_the_same_bytes_and_outcomes(store):
    """`get_into(on_part=...)`: the same bytes and sizes as a plain read, a missing key still -1. A backend that
    reads files calls back once per part, in order, and each call comes after that part of every block is in (the
    parts checked at the time of the call); one whose bytes come whole (Redis inline) never calls back."""
    led = BlockLedger(store)
    keys, blocks = chain(3, seed=6)
    assert led.put_chain(keys, blocks) == (3, 0, 0)
    cuts = (100, 1000, BLOCK - 1100)
    dests = [tuple(bytearray(n) for n in cuts) for _ in range(4)]
    seen: list[int] = []

    def on_part(k: int) -> None:
        seen.append(k)
        assert all(bytes(d[k - 1]) == b[sum(cuts[:k - 1]):sum(cuts[:k])] for d, b in zip(dests, blocks))

    assert store.get_into(keys + [b"\x01" * 16], dests, on_part=on_part) == [BLOCK] * 3 + [-1]
    assert [b"".join(bytes(p) for p in d) for d in dests[:3]] == blocks
    assert seen == ([] if store.files is None else [1, 2, 3])


def test_empty_calls(store):
    led = BlockLedger(store)
    assert led.match([]) == 0 and led.get_into([], []) == [] and led.exists([]) == []
    assert led.put_chain([], []) == (0, 0, 0) and led.delete([]) == 0
    st = led.stats()
    assert st.blocks == 0 and st.chains == 0 and st.live_bytes == 0


def test_delete_a_tail(store):
    led = BlockLedger(store)
    keys, blocks = chain(10)
    led.put_chain(keys, blocks)
    assert led.delete(keys[6:]) == 4
    assert led.match(keys) == 6
    assert led.get_into(keys[5:7], [bytearray(BLOCK), bytearray(BLOCK)]) == [BLOCK, -1]
    assert led.put_chain(keys, blocks) == (4, 6, 0)  # what was deleted is written again


def test_stats_count_blocks_chains_classes_and_namespaces(store):
    led = BlockLedger(store, TtlPolicy.parse(namespaces="a=agent"))
    k1, b1 = chain(5, "a")
    led.put_chain(k1, b1, namespace="a", parent=root("a"))
    k2, b2 = chain(3, "b")
    led.put_chain(k2, b2, namespace="b")
    st = led.stats()
    assert (st.blocks, st.chains, st.live_bytes) == (8, 2, 8 * BLOCK)
    assert st.per_class == {"agent": 5, "chatbot": 3} and st.per_namespace == {"a": 5, "b": 3}
    assert st.oldest_created is not None and st.next_expiry is not None and st.next_expiry > st.oldest_created
    assert sorted(b.pos for b in store.blocks()) == [0, 0, 1, 1, 2, 2, 3, 4]
    assert {b.key for b in store.blocks()} == set(k1) | set(k2)


def test_verify_a_clean_store_and_gc_with_nothing_due(store):
    led = BlockLedger(store)
    keys, blocks = chain(6)
    led.put_chain(keys, blocks)
    assert led.verify() == (6, 0, 0, 6 * BLOCK)
    res = led.gc()
    assert res.expired == 0 and res.evicted == 0
    assert led.match(keys) == 6


def test_expired_blocks_are_never_matched_nor_read(store):
    """Real time: a 1 s class (Redis expires on its own clock; the file store's clock is the wall clock)."""
    led = BlockLedger(store, TtlPolicy.parse(f"blink={1 / DAY_S}"))
    keys, blocks = chain(3, seed=4)
    t0 = time.monotonic()
    led.put_chain(keys, blocks, ttl_class="blink")
    assert led.get_into(keys[:1], [bytearray(BLOCK)]) == [BLOCK]
    time.sleep(max(0.0, 1.2 - (time.monotonic() - t0)))
    assert led.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [-1] * 3
    assert led.match(keys, ttl_class="blink") == 0 and led.exists(keys) == [False] * 3


def test_a_too_small_buffer_or_a_missing_buffer_is_refused(store):
    led = BlockLedger(store)
    keys, blocks = chain(2)
    led.put_chain(keys, blocks)
    with pytest.raises(ValueError):
        led.get_into(keys, [bytearray(BLOCK)])
    with pytest.raises(ValueError):
        led.put_chain(keys, blocks[:1])


def test_a_namespace_cut_inside_a_character_is_counted_under_one_name(store):
    """A namespace whose 1,024th byte falls inside a character (`backend.MAX_NAME_BYTES`): stats count its blocks
    under one readable name, `blocks()` lists them. (Before, the LMDB store recorded the name cut at that byte,
    and its stats raised UnicodeDecodeError.)"""
    ns = "a" * 1023 + "é"
    led = BlockLedger(store)
    keys, blocks = chain(2, ns)
    assert led.put_chain(keys, blocks, namespace=ns).written == 2
    (name,) = led.stats().per_namespace
    assert led.stats().per_namespace == {name: 2} and name.startswith("a" * 200)
    assert {b.namespace for b in store.blocks()} == {name}
