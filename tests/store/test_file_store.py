"""The embedded file store: round trips, CHECK, TTL, GC, eviction, rebuild, corruption."""

from __future__ import annotations

import os
from pathlib import Path


from kvledger.store import segment as sg
from kvledger.store.file_backend import FileStore
from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import BLOCK, chain, root


def open_ledger(path: Path, clock, policy: TtlPolicy | None = None, **kw) -> BlockLedger:
    return BlockLedger(FileStore(path, fsync=False, clock=clock, **kw), policy)


def segs(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*" + sg.SUFFIX))


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


def test_index_rebuilt_at_open_without_reading_blocks(tmp_path, clock):
    keys, blocks = chain(20)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys, blocks)
    # flip a byte of every block: a rebuild that read blocks would notice; CHECK must not
    overwrite_in_every_block(tmp_path, 0, b"\xff")
    with open_ledger(tmp_path, clock) as led:
        assert len(led.store.index) == 20 and led.match(keys) == 20
        bufs = [bytearray(BLOCK) for _ in keys]
        assert led.get_into(keys, bufs) == [-1] * 20  # ...and every flipped block reads as a miss
        assert led.store.counters.misses_corrupt == 20
        assert led.match(keys) == 0  # bad blocks are dropped


def test_ttl_classes_expiry_and_refresh_on_hit(tmp_path, clock):
    led = open_ledger(tmp_path, clock, policy=TtlPolicy.parse(namespaces="agents=agent"))
    ka, ba = chain(4, "agents")
    kc, bc = chain(4, "chat")
    led.put_chain(ka, ba, namespace="agents")
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


def test_gc_removes_tails_first_truncating_the_segment(tmp_path, clock):
    keys, blocks = chain(10)
    led = open_ledger(tmp_path, clock)
    led.put_chain(keys, blocks, ttl_class="agent")
    (seg,) = segs(tmp_path)
    full = seg.stat().st_size
    clock.advance(2 * DAY_S)
    assert led.match(keys[:6], ttl_class="agent") == 6
    clock.advance(1.5 * DAY_S)  # blocks 6..9 expired, 0..5 were refreshed
    res = led.gc(batch=3)
    assert res.expired == 4 and res.batches == 2 and res.freed_bytes == 4 * BLOCK
    assert seg.stat().st_size == full - 4 * BLOCK  # the tail was cut off the file
    assert led.match(keys, ttl_class="agent") == 6
    clock.advance(3 * DAY_S + 1)
    assert led.gc().expired == 6
    assert segs(tmp_path) == []  # an empty segment is unlinked
    st = led.stats()
    assert st.blocks == 0 and st.disk_bytes == 0 and led.store.counters.gc_expired == 10


def test_gc_and_refresh_survive_reopen(tmp_path, clock):
    keys, blocks = chain(6)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys, blocks, ttl_class="agent")
        clock.advance(2 * DAY_S)
        assert led.match(keys[:3], ttl_class="agent") == 3
    clock.advance(2 * DAY_S)  # without the flushed refresh, all 6 would have expired
    with open_ledger(tmp_path, clock) as led:
        assert led.match(keys) == 3
        led.gc()
    with open_ledger(tmp_path, clock) as led:
        assert len(led.store.index) == 3


def test_capacity_evicts_least_recently_hit_tails_first(tmp_path, clock):
    cap = 20 * BLOCK
    led = open_ledger(tmp_path, clock, capacity_bytes=cap)
    k1, b1 = chain(8, seed=1)
    k2, b2 = chain(8, seed=2)
    led.put_chain(k1, b1)
    clock.advance(10)
    led.put_chain(k2, b2)
    clock.advance(10)
    assert led.match(k1) == 8  # chain 1 is now the most recently hit
    k3, b3 = chain(8, seed=3)
    clock.advance(10)
    assert led.put_chain(k3, b3).written == 8  # 24 blocks > 20: evict down to 0.9 × 20 − 8 = 10
    assert led.store.live_bytes <= cap
    assert led.match(k1) == 8 and led.match(k3) == 8
    assert led.match(k2) == 2  # chain 2's tail went first; its head survives
    assert led.stats().counters["gc_evicted"] == 6
    assert led.put_chain([], []) == (0, 0, 0)


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


def test_verify_reports_and_removes_bad_blocks_and_segments(tmp_path, clock):
    keys, blocks = chain(12)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys[:6], blocks[:6])
        led.put_chain(keys[6:], blocks[6:], start_pos=6, parent=keys[5])
    a, b = segs(tmp_path)
    meta = sg.read_meta(os.open(a, os.O_RDONLY))
    with open(a, "r+b") as f:  # flip a byte in block 2 of the first segment
        f.seek(meta.entries[2][5] + 17)
        x = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([x[0] ^ 1]))
    with open(b, "r+b") as f:  # and break the second segment's metadata
        f.seek(80)
        f.write(b"garbage")
    with open_ledger(tmp_path, clock) as led:
        assert led.match(keys) == 6  # second segment is ignored
        res = led.verify()
        assert res.checked == 6 and res.bad == 2 and res.removed == 2
        assert led.match(keys) == 2
        assert led.verify() == (5, 0, 0, 5 * BLOCK)
    assert len(segs(tmp_path)) == 1
    with open_ledger(tmp_path, clock) as led:  # the removal persisted (dead flag)
        assert led.match(keys) == 2 and len(led.store.index) == 5


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


FULL_DISK = """
import resource, signal, sys
from kvledger.store.ledger import BlockLedger
from tests.store.conftest import chain
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # files past 20 kB fail with EFBIG, like a full disk
led = BlockLedger.open(path=sys.argv[1], fsync=False, index="scan")
keys, blocks = chain(8)
print(tuple(led.put_chain(keys, blocks)), led.store.counters.put_failures, led.match(keys))
print(tuple(led.put_chain(keys[:2], blocks[:2])), led.match(keys))  # a small put still fits
"""


def test_full_disk_fails_soft(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["(0, 0, 8) 1 0", "(2, 0, 0) 2"]
    assert "put of 8 blocks" in out.stderr  # logged
    assert [p.name for p in (tmp_path / "segments").iterdir() if not p.name.endswith(sg.SUFFIX)] == []


def test_check_never_waits_for_a_put_in_progress(tmp_path, clock):
    import threading
    import time

    keys, blocks = chain(4)
    led = open_ledger(tmp_path, clock)
    led.put_chain(keys, blocks)
    held, done = threading.Event(), threading.Event()

    def slow_put() -> None:  # holds the store as a put does during its fsync
        with led.store._lock:
            (tmp_path / "segments" / ".tmp-other-1-x").write_bytes(b"")  # the directory changes meanwhile
            held.set()
            done.wait(5)

    t = threading.Thread(target=slow_put)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    assert led.match(keys) == 4
    assert time.monotonic() - t0 < 0.5
    done.set()
    t.join()


def test_get_into_never_serves_an_expired_block(tmp_path, clock):
    keys, blocks = chain(4)
    led = open_ledger(tmp_path, clock)
    led.put_chain(keys, blocks, ttl_class="agent")
    clock.advance(3 * DAY_S - 1)
    assert led.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * 4
    clock.advance(2)  # expired, not yet collected: still in the index and on disk
    assert len(led.store.index) == 4 and segs(tmp_path)[0].stat().st_size > 4 * BLOCK
    assert led.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [-1] * 4
    assert led.store.counters.misses_absent == 4


def test_rebuild_sees_a_segment_truncated_while_closed(tmp_path, clock):
    """No process read the cut blocks, so no dead flag records them: only the file size does."""
    keys, blocks = chain(8)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys, blocks)
    (seg,) = segs(tmp_path)
    meta = sg.read_meta(os.open(seg, os.O_RDONLY))
    assert set(meta.flags) == {sg.FLAG_LIVE}
    os.truncate(seg, seg.stat().st_size - BLOCK - 100)  # cut into block 6
    with open_ledger(tmp_path, clock) as led:
        assert len(led.store.index) == 6 and led.match(keys) == 6
        assert led.store.live_bytes == 6 * BLOCK
        assert led.get_into(keys[:6], [bytearray(BLOCK) for _ in range(6)]) == [BLOCK] * 6


def test_gc_counts_blocks_already_expired_at_open(tmp_path, clock):
    keys, blocks = chain(5)
    with open_ledger(tmp_path, clock) as led:
        led.put_chain(keys, blocks, ttl_class="agent")
    clock.advance(3 * DAY_S + 1)
    with open_ledger(tmp_path, clock) as led:
        res = led.gc()
        assert res.expired == 5 and res.freed_bytes > 5 * BLOCK and segs(tmp_path) == []
        assert led.store.counters.gc_expired == 5
        assert led.gc().expired == 0  # counted once


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


CHECK_ONLY = """
import os, sys, time
from kvledger.store.file_backend import FileStore
from kvledger.store.ledger import BlockLedger
from kvledger.store.ttl import TtlPolicy
from tests.store.conftest import chain
led = BlockLedger(FileStore(sys.argv[1], writeback_s=float(sys.argv[2])), TtlPolicy.parse("long=1"))
keys = chain(6)[0]
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.005)
print(led.match(keys, ttl_class="long"), flush=True)  # a CHECK, nothing else: no put, no close
time.sleep(60)  # killed with SIGKILL by the test
"""


def test_a_check_only_process_keeps_its_hits_alive_for_another_processes_gc(tmp_path, run_cli):
    """Two real processes: one only CHECKs (then dies without closing), another runs `kvledger store gc`."""
    import json
    import subprocess
    import sys
    import time

    store_dir, go = tmp_path / "store", tmp_path / "go"
    FileStore(store_dir).close()
    writeback_s = 0.3
    p = subprocess.Popen([sys.executable, "-c", CHECK_ONLY, str(store_dir), str(writeback_s), str(go)], text=True,
                         stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])
    try:
        assert p.stdout.readline().strip() == "ready"
        keys, blocks = chain(6)
        with BlockLedger(FileStore(store_dir, fsync=False), TtlPolicy.parse(f"blink={2 / DAY_S}")) as led:
            led.put_chain(keys, blocks, ttl_class="blink")  # lives 2 s unless hit
        born = time.time()
        go.touch()
        assert p.stdout.readline().strip() == "6"
        time.sleep(max(writeback_s * 3, born + 2.3 - time.time()))  # the blocks' own TTL has run out
        p.kill()  # no close, no flush at exit: only the write-back made the refresh durable
    finally:
        p.kill()
        p.wait(timeout=10)
        p.stdout.close()
    r = run_cli("store", "gc", "--path", str(store_dir), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["expired"] == 0
    with open_ledger(store_dir, time.time) as led:
        assert led.match(keys) == 6


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
