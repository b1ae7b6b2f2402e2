"""The embedded store (segment files + the LMDB index): segments per put, TTL classes, refresh across
reopens and processes, truncated and damaged blocks, stats. (Moved from the retired scan store's tests.)"""

from __future__ import annotations

import os
from pathlib import Path


from kvledger.store import segment as sg
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import BLOCK, chain, root


def open_ledger(path: Path, clock, policy: TtlPolicy | None = None, **kw) -> BlockLedger:
    return BlockLedger(LmdbStore(path, fsync=False, clock=clock, **kw), policy)


def segs(path: Path) -> list[Path]:
    return sorted((path / "segments").rglob("*" + sg.SUFFIX))


def overwrite_in_every_block(path: Path, at: int, byte: bytes) -> None:
    """`byte` written at offset `at` inside every block of every segment under `path`."""
    for p in segs(path):
        meta = sg.read_meta(os.open(p, os.O_RDONLY))
        with open(p, "r+b") as f:
            for e in meta.entries:
                f.seek(e[5] + at)
                f.write(byte)


def test_one_segment_per_put(tmp_path, clock):
    """(The contract itself — round trip, idempotence, CHECK — is in test_contract.py, for every backend.)"""
    keys, blocks = chain(40)
    with open_ledger(tmp_path, clock) as led:
        assert led.put_chain(keys[:30], blocks[:30]) == (30, 0, 0)
        assert led.put_chain(keys, blocks, parent=None) == (10, 30, 0)
        assert len(segs(tmp_path)) == 2


def test_ttl_classes_expiry_and_refresh_on_hit(tmp_path, clock):
    led = open_ledger(tmp_path, clock, policy=TtlPolicy.parse(namespaces="agents=agent"))
    ka, ba = chain(4, "agents")
    kc, bc = chain(4, "chat")
    led.put_chain(ka[:2], ba[:2], namespace="agents")   # two segments: expiry is per segment (per put)
    led.put_chain(ka[2:], ba[2:], namespace="agents", start_pos=2, parent=ka[1])
    led.put_chain(kc, bc, namespace="chat")
    clock.advance(3 * DAY_S - 60)
    assert led.match(ka, namespace="agents") == 4  # a hit refreshes: 3 more days from now
    clock.advance(2 * DAY_S)
    assert led.match(ka[:2], namespace="agents") == 2  # refreshes only the 2 leading blocks
    clock.advance(1.5 * DAY_S)
    assert led.match(ka, namespace="agents") == 2  # blocks 2, 3 expired; 0, 1 were refreshed
    assert led.match(kc, namespace="chat") == 4  # chatbot: 7 days
    clock.advance(7 * DAY_S + 1)
    assert led.match(kc, namespace="chat") == 0
    # a request's own class overrides its namespace's
    kx, bx = chain(2, "agents", seed=3)
    led.put_chain(kx, bx, namespace="agents", ttl_class="chatbot")
    clock.advance(5 * DAY_S)
    assert led.match(kx, namespace="agents") == 2


def test_gc_and_refresh_survive_reopen(tmp_path, clock):
    keys, blocks = chain(6)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys[:3], blocks[:3], ttl_class="agent")   # two segments: expiry is per segment
        led.put_chain(keys[3:], blocks[3:], ttl_class="agent", start_pos=3, parent=keys[2])
        clock.advance(2 * DAY_S)
        assert led.match(keys[:3], ttl_class="agent") == 3
    clock.advance(2 * DAY_S)  # without the flushed refresh, all 6 would have expired
    with open_ledger(tmp_path, clock) as led:
        assert led.match(keys) == 3
        led.gc()
    with open_ledger(tmp_path, clock) as led:
        assert led.stats().blocks == 3


def test_truncated_segment_reads_as_miss_and_counts(tmp_path, clock):
    keys, blocks = chain(8)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys, blocks)
        (seg,) = segs(tmp_path)
        os.truncate(seg, seg.stat().st_size - BLOCK - 100)  # cut into block 6
        bufs = [bytearray(BLOCK) for _ in keys]
        got = led.get_into(keys, bufs)
        assert got[:6] == [BLOCK] * 6 and got[6:] == [-1, -1]
        assert led.store.counters.misses_truncated == 2
        assert [bytes(b) for b in bufs[:6]] == blocks[:6]
        assert led.match(keys) == 6
    with open_ledger(tmp_path, clock) as led:  # a rebuild sees the truncation in the metadata
        assert led.match(keys) == 6


def test_stats(tmp_path, clock):
    led = open_ledger(tmp_path, clock, policy=TtlPolicy.parse(namespaces="a=agent"))
    k1, b1 = chain(5, "a")
    led.put_chain(k1, b1, namespace="a", parent=root("a"))
    clock.advance(100)
    k2, b2 = chain(3, "b")
    led.put_chain(k2, b2, namespace="b")
    led.put_chain(k2[:2] + [k1[0]], b2[:2] + [b1[0]], namespace="b")  # all present
    st = led.stats()
    assert st.blocks == 8 and st.chains == 2 and st.live_bytes == 8 * BLOCK and st.segments == 2
    assert st.per_class == {"agent": 5, "chatbot": 3} and st.per_namespace == {"a": 5, "b": 3}
    assert st.oldest_created == clock.t - 100
    assert st.next_expiry == clock.t - 100 + 3 * DAY_S
    assert st.disk_bytes > st.live_bytes and st.counters["blocks_skipped"] == 3


def test_get_into_never_serves_an_expired_block(tmp_path, clock):
    keys, blocks = chain(4)
    led = open_ledger(tmp_path, clock)
    led.put_chain(keys, blocks, ttl_class="agent")
    clock.advance(3 * DAY_S - 1)
    assert led.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * 4
    clock.advance(2)  # expired, not yet collected: still in the index and on disk
    assert led.stats().blocks == 4 and segs(tmp_path)[0].stat().st_size > 4 * BLOCK
    assert led.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [-1] * 4
    assert led.store.counters.misses_absent == 4


def test_gc_of_a_long_lived_process_sees_refreshes_other_processes_wrote(tmp_path, clock):
    keys, blocks = chain(4)
    gc_side = open_ledger(tmp_path, clock)
    gc_side.put_chain(keys, blocks, ttl_class="agent")
    check_side = open_ledger(tmp_path, clock)
    clock.advance(2 * DAY_S)
    assert check_side.match(keys, ttl_class="agent") == 4
    check_side.store.flush()
    clock.advance(2 * DAY_S)  # expired in gc_side's memory, refreshed on disk
    assert gc_side.gc().expired == 0 and gc_side.match(keys, ttl_class="agent") == 4
    check_side.close()
    gc_side.close()


def test_a_damaged_block_is_flagged_dead_on_disk_at_once(tmp_path, clock):
    """Issue 19 item 4: the first process that reads a damaged copy flags it dead in its segment, so the
    processes that open the store later neither read it again nor take it for present (a put then writes
    the block anew), and one that had indexed it takes the new copy. Before, each new process loaded the
    bad copy, missed, and a put skipped it as present."""
    keys, blocks = chain(20)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys, blocks)
    overwrite_in_every_block(tmp_path, 7, b"\xaa")
    bufs = [bytearray(BLOCK) for _ in keys]
    first = open_ledger(tmp_path, clock)   # stays open (a running engine): not its close writes the flags
    stale = open_ledger(tmp_path, clock)   # opened before anyone read the bad copies: it indexed them
    assert first.get_into(keys, bufs) == [-1] * 20 and first.store.counters.misses_corrupt == 20
    with open_ledger(tmp_path, clock) as later:
        assert later.match(keys) == 0 and later.get_into(keys, bufs) == [-1] * 20
        assert later.store.counters.misses_corrupt == 0 and later.store.counters.misses_absent == 20
        assert later.put_chain(keys, blocks) == (20, 0, 0)
    # the copies written again supersede the bad ones it indexed (the newer copy of a key wins)
    stale.store.refresh(force=True)
    assert stale.get_into(keys, bufs) == [BLOCK] * 20 and stale.store.counters.misses_corrupt == 0
    stale.close()
    first.close()
    with open_ledger(tmp_path, clock) as after:
        assert after.get_into(keys, bufs) == [BLOCK] * 20
        assert [bytes(b) for b in bufs] == [bytes(b) for b in blocks]
