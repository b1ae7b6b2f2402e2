"""Tombstones (issue 24): why the first absent block of a CHECK is absent — expired or evicted, and when —
answered by `match_explained` in the CHECK's own call, on the embedded store (LMDB) and on Redis."""

from __future__ import annotations

import os

import pytest

from kvledger.core.attribution import MissCause
from kvledger.store.backend import ChainWrite, Gone, Match
from kvledger.store.ledger import BlockLedger
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import BLOCK, chain
from .test_embedded_store import overwrite_in_every_block, segs

EXPIRED, EVICTED = MissCause.EXPIRED, MissCause.EVICTED


def put(store, keys, blocks, start=0, ttl_s=100.0):
    parent = keys[start - 1] if start else bytes(16)
    return store.put(ChainWrite(keys[start:], blocks[start:], start, parent, "default", "agent", ttl_s))


# --- the embedded store ------------------------------------------------------------------------------

def test_lmdb_expired_reads_as_expired_at_its_expiry_before_and_after_gc(tmp_path, clock):
    keys, blocks = chain(12)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys[:8], blocks[:8], ttl_s=100)
        clock.advance(10)
        put(store, keys, blocks, start=8, ttl_s=100)       # a second segment; extending refreshes the first
        expiry = clock.t + 100
        assert store.match_explained(keys, 100) == Match(12)
        clock.advance(101)                                  # both expired; not collected yet
        assert store.match_explained(keys, 100) == Match(0, Gone(EXPIRED, expiry))
        assert store.match(keys, 100) == 0
        clock.advance(50)
        assert store.gc().expired == 12
        assert store.match_explained(keys, 100) == Match(0, Gone(EXPIRED, expiry))   # its tombstone now
        assert store.match_explained(keys[8:], 100) == Match(0, Gone(EXPIRED, expiry))


def test_lmdb_explained_match_answers_and_refreshes_as_match_does(tmp_path, clock):
    keys, blocks = chain(10)
    other, _ = chain(3, seed=9)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.match_explained(keys, 100) == Match(0)                    # never stored: no tombstone
        put(store, keys[:6], blocks[:6], ttl_s=100)
        assert store.match_explained(keys, 100) == Match(6)                    # keys[6] never stored
        assert store.match_explained(keys[:3] + other, 100) == Match(3)
        clock.advance(90)
        assert store.match_explained(keys, 100) == Match(6)                    # refreshes to now + 100
        clock.advance(90)
        assert store.match(keys, 100) == 6
        assert store.match_explained([], 100) == Match(0)


def test_lmdb_eviction_for_room_leaves_evicted_tombstones(tmp_path, clock):
    keys, blocks = chain(10)
    other, other_blocks = chain(6, seed=3)
    with LmdbStore(tmp_path, fsync=False, clock=clock, capacity_bytes=14 * BLOCK) as store:
        put(store, keys[:5], blocks[:5])
        clock.advance(1)
        put(store, keys, blocks, start=5)
        clock.advance(1)
        assert store.match(keys[:5], 100) == 5     # hit: the head is the most recently used
        clock.advance(1)
        put(store, other, other_blocks)            # 16 blocks > 14: evict the least recently hit, the tail
        assert store.counters.gc_evicted == 5
        assert store.match_explained(keys, 100) == Match(5, Gone(EVICTED, clock.t))
        assert store.match_explained(other, 100) == Match(6)


def test_lmdb_gc_for_capacity_evicts_with_tombstones(tmp_path, clock):
    keys, blocks = chain(10)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
    clock.advance(5)
    with LmdbStore(tmp_path, fsync=False, clock=clock, capacity_bytes=5 * BLOCK) as store:
        assert store.gc().evicted == 10            # one segment: all of it, down to 0.9 × capacity
        assert store.match_explained(keys, 100) == Match(0, Gone(EVICTED, clock.t))


def test_lmdb_a_damaged_block_removed_leaves_an_evicted_tombstone(tmp_path, clock):
    keys, blocks = chain(6)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
    overwrite_in_every_block(tmp_path, 7, b"\xaa")
    clock.advance(3)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.get_into(keys[2:3], [bytearray(BLOCK)]) == [-1]   # a checksum miss: dropped from the index
        assert store.match_explained(keys, 100) == Match(2, Gone(EVICTED, clock.t))
        clock.advance(1)
        assert store.verify().removed == 5
        assert store.match_explained(keys, 100) == Match(0, Gone(EVICTED, clock.t))
        assert not segs(tmp_path)


def test_lmdb_delete_leaves_an_evicted_tombstone_and_a_put_makes_the_block_present_again(tmp_path, clock):
    keys, blocks = chain(6)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
        assert store.delete(keys[4:]) == 2
        assert store.match_explained(keys, 100) == Match(4, Gone(EVICTED, clock.t))
        put(store, keys, blocks, start=4)
        assert store.match_explained(keys, 100) == Match(6)


def test_lmdb_tombstones_persist_and_are_seen_by_another_store_of_the_folder(tmp_path, clock):
    keys, blocks = chain(4)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks, ttl_s=10)
        clock.advance(11)
        assert store.gc().expired == 4
    with LmdbStore(tmp_path, fsync=False, clock=clock) as again:
        assert again.match_explained(keys, 10) == Match(0, Gone(EXPIRED, clock.t - 1))


def test_the_table_is_bounded_and_drops_the_oldest(tmp_path, clock):
    keys, blocks = chain(30)
    with LmdbStore(tmp_path, fsync=False, clock=clock, tombstones=8) as store:
        for i in range(0, 30, 10):       # three segments of one chain (each put refreshes the ones before)
            put(store, keys[:i + 10], blocks[:i + 10], start=i, ttl_s=10)
            clock.advance(1)
        clock.advance(10)
        assert store.gc().expired == 30  # one expiry: buried tails first, so the head's are the newest
        with store.index.env.begin() as txn:
            assert store.tombs.count(txn) == 8 and txn.stat(store.index.tomb_order)["entries"] == 8
        kept = [i for i, k in enumerate(keys) if store.match_explained([k], 10).gone is not None]
        assert kept == list(range(2, 10))
        assert store.match_explained(keys[2:], 10) == Match(0, Gone(EXPIRED, clock.t - 1))
        assert store.match_explained(keys, 10) == Match(0)   # keys[0]'s tombstone went with the bound


def test_a_key_buried_again_keeps_one_tombstone(tmp_path, clock):
    keys, blocks = chain(3)
    with LmdbStore(tmp_path, fsync=False, clock=clock, tombstones=5) as store:
        for _ in range(4):
            put(store, keys, blocks)
            assert store.delete(keys) == 3
            clock.advance(1)
        with store.index.env.begin() as txn:
            assert store.tombs.count(txn) == 3 and txn.stat(store.index.tomb_order)["entries"] == 3
        assert store.match_explained(keys, 10) == Match(0, Gone(EVICTED, clock.t - 1))


def test_tombstone_bytes_at_scale(tmp_path, clock):
    """The figure the lmdb_tombs docstring states: bytes per tombstone in the index file, at 20,000."""
    n = 20_000
    with LmdbStore(tmp_path, fsync=False, clock=clock, tombstones=n) as store:
        keys = [os.urandom(16) for _ in range(n + 1000)]
        with store.index.env.begin(write=True) as w:
            for i in range(0, len(keys), 1000):
                store.tombs.bury(w, keys[i:i + 1000], EXPIRED, clock.t)
        with store.index.env.begin() as txn:
            assert store.tombs.count(txn) == n
            pages = sum(txn.stat(db)["branch_pages"] + txn.stat(db)["leaf_pages"] + txn.stat(db)["overflow_pages"]
                        for db in (store.index.tombs, store.index.tomb_order))
            psize = txn.stat(store.index.tombs)["psize"]
        per = pages * psize / n
        print(f"tombstone bytes: {per:.0f} B each at {n}")
        assert 40 < per < 160


def test_a_ledger_resolves_the_class_and_passes_through(tmp_path, clock):
    led = BlockLedger(LmdbStore(tmp_path, fsync=False, clock=clock), TtlPolicy.parse("blink=0.001"))
    keys, blocks = chain(3)
    led.put_chain(keys, blocks, ttl_class="blink")
    clock.advance(0.001 * DAY_S + 1)
    assert led.match_explained(keys, ttl_class="blink") == Match(0, Gone(EXPIRED, clock.t - 1))
    with pytest.raises(ValueError):
        led.match_explained(keys, ttl_class="nope")
    led.close()
