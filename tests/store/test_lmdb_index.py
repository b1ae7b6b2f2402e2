"""The persisted LMDB index (LmdbStore): CHECK by bisection, TTL per segment, GC in batches, compaction,
migration from the previous layout, verify, and no directory listing on the hot paths."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.store import segment as sg
from kvledger.store.backend import ChainWrite
from kvledger.store.chain_check import leading_present
from kvledger.store.ledger import BlockLedger
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.shared_files import SharedFiles

from .conftest import BLOCK, block_of, chain

REPO = Path(__file__).parents[2]


def put(store, keys, blocks, start=0, ttl_s=100.0, ns="default"):
    parent = keys[start - 1] if start else bytes(16)
    return store.put(ChainWrite(keys[start:], blocks[start:], start, parent, ns, "agent", ttl_s))


def put_in_segments(store, keys, blocks, per_put, ttl_s=100.0):
    for s in range(0, len(keys), per_put):
        end = s + per_put
        parent = keys[s - 1] if s else bytes(16)
        store.put(ChainWrite(keys[s:end], blocks[s:end], s, parent, "default", "agent", ttl_s))


def write_previous_layout(root, write: ChainWrite, now: float, expiry: float | None = None) -> None:
    """One segment as the retired scan store wrote it (flat segments/NAME.kvs, no index; SharedFiles writes that
    layout); `expiry`: its blocks' expiry as that store's hits rewrote it in the segment's mutable arrays."""
    files = SharedFiles(root, fsync=False)
    name = files.write(write, range(len(write.keys)), [memoryview(b) for b in write.blocks], now)[0].name
    if expiry is not None:
        meta, _ = files.files.read_meta(name)
        with open(files.files.seg_dir / name, "r+b") as f:
            f.seek(meta.layout.expiry_off)
            f.write(struct.pack(f"<{len(write.keys)}d", *[expiry] * len(write.keys)))
    files.close()


def read_all(store, keys):
    bufs = [bytearray(BLOCK) for _ in keys]
    sizes = store.get_into(keys, bufs)
    wrong = sum(1 for k, b, n in zip(keys, bufs, sizes) if n >= 0 and bytes(b) != block_of(k))
    return sizes, wrong


# --- the bisection --------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 8192])
def test_leading_present_finds_every_boundary_in_few_probes(n):
    for b in sorted({0, 1, n // 3, n - 1, n} - {-1}):
        if not 0 <= b <= n:
            continue
        probes: list[int] = []
        got = leading_present(n, lambda i, b=b, probes=probes: probes.append(i) or i < b)
        assert got == b
        assert len(probes) <= max(n, 1).bit_length() + 2 + 16, "a CHECK must not probe every block"


def test_leading_present_check_catches_a_sampled_hole():
    n = 8192
    hole = int(8 * (n - 1) / 17)   # the 8th of the 16 positions spread evenly below the found boundary
    probes = []
    assert leading_present(n, lambda i: probes.append(i) or i != hole) == hole
    assert len(probes) < 64


# --- the store ------------------------------------------------------------------------

def test_roundtrip_check_and_idempotent_puts(tmp_path, clock):
    keys, blocks = chain(40)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.match(keys, 100) == 0
        assert put(store, keys[:30], blocks[:30]) == (30, 0, 0)
        assert put(store, keys, blocks) == (10, 30, 0)
        assert store.match(keys, 100) == 40 and store.match(keys[:3] + chain(5, seed=9)[0], 100) == 3
        assert read_all(store, keys) == ([BLOCK] * 40, 0)
        st = store.stats()
        assert (st.blocks, st.segments, st.chains, st.live_bytes) == (40, 2, 1, 40 * BLOCK)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:  # persisted: nothing rebuilt
        assert store.match(keys, 100) == 40


def test_hit_refreshes_whole_prefix_tails_expire_first(tmp_path, clock):
    keys, blocks = chain(30)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put_in_segments(store, keys, blocks, 10, ttl_s=100)
        clock.advance(90)
        assert store.match(keys[:20], 100) == 20   # refreshes the first two segments (walk to the head)
        clock.advance(20)                         # the third segment (never hit) expired
        assert store.match(keys, 100) == 20
        assert store.gc().expired == 10
        clock.advance(85)
        assert store.match(keys, 100) == 20
        clock.advance(101)
        res = store.gc(batch=5)
        assert res.expired == 20 and res.batches == 2   # one segment (10 blocks) per batch of ≥ 5
        assert store.stats().blocks == 0 and not list((tmp_path / "segments").rglob("*" + sg.SUFFIX))


def test_refresh_reaches_another_process(tmp_path):
    keys, blocks = chain(8)
    with LmdbStore(tmp_path, fsync=False) as store:
        put(store, keys, blocks, ttl_s=2.0)
        assert store.match(keys, 300.0) == 8
        time.sleep(0.5)   # the refresh thread writes within milliseconds; give a loaded machine slack
        time.sleep(2.0)   # past the 2 s TTL of the put: only the refresh keeps the blocks
        code = ("import sys; from kvledger.store.lmdb_store import LmdbStore; from tests.store.conftest import chain\n"
                "s = LmdbStore(sys.argv[1], fsync=False); print(s.match(chain(8)[0], 1.0))")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.strip() == "8", out.stderr


def test_capacity_evicts_least_recently_hit_tails_first(tmp_path, clock):
    a, b = chain(20, seed=1), chain(20, seed=2)
    with LmdbStore(tmp_path, fsync=False, clock=clock, capacity_bytes=45 * BLOCK, low_watermark=1.0) as store:
        put_in_segments(store, *a, 10)
        clock.advance(1)
        put_in_segments(store, *b, 10)
        clock.advance(1)
        assert store.match(a[0], 100) == 20      # a is now the most recently hit
        c = chain(10, seed=3)
        assert put(store, *c).written == 10      # needs 5 blocks of room: b's tail segment goes
        assert store.match(b[0], 100) == 10 and store.match(a[0], 100) == 20 and store.match(c[0], 100) == 10


def test_delete_then_compaction_reclaims_the_middle(tmp_path, clock):
    keys, blocks = chain(40)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
        disk0 = store.stats().disk_bytes
        assert store.delete(keys[5:35]) == 30
        res = store.gc()
        assert res.batches >= 1
        st = store.stats()
        assert st.blocks == 10 and st.disk_bytes < disk0 / 2 and st.segments == 1
        sizes, wrong = read_all(store, keys[:5] + keys[35:])
        assert sizes == [BLOCK] * 10 and wrong == 0
        assert store.verify(orphan_age_s=0).bad == 0


def test_corrupt_block_is_a_miss_dropped_and_verify_finds_orphans(tmp_path, clock):
    keys, blocks = chain(10)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put(store, keys, blocks)
        (path,) = (tmp_path / "segments").rglob("*" + sg.SUFFIX)
        meta = sg.read_meta(os.open(path, os.O_RDONLY))
        with open(path, "r+b") as f:
            f.seek(meta.entries[6][5])
            f.write(b"\xff\xfe")
        orphan = path.parent / ("orphan" + sg.SUFFIX)
        orphan.write_bytes(b"x" * 100)
        assert store.match(keys, 100) == 10       # CHECK reads metadata only
        sizes, wrong = read_all(store, keys)
        assert wrong == 0 and sizes[6] == -1 and sizes.count(BLOCK) == 9
        assert BlockLedger(store).read_prefix(keys, [bytearray(BLOCK) for _ in keys]) == 6
        assert store.match(keys, 100) == 6        # the bad block was dropped: the chain ends before it
        res = store.verify(orphan_age_s=0)
        assert (res.checked, res.bad, res.removed) == (9, 1, 1) and not orphan.exists()


def test_migration_keeps_the_blocks_of_the_previous_layout(tmp_path, clock):
    live, gone = chain(30, seed=1), chain(10, seed=2)
    born = clock()
    write_previous_layout(tmp_path, ChainWrite(live[0], live[1], 0, bytes(16), "tenant", "chatbot", 700.0), born,
                          expiry=born + 50 + 1000)   # a hit at +50 refreshed it in the segment's mutable arrays
    write_previous_layout(tmp_path, ChainWrite(gone[0], gone[1], 0, bytes(16), "tenant", "agent", 100.0), born)
    clock.advance(50)
    clock.advance(200)                            # `gone` expired, `live` not
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.match(live[0], 1.0) == 30 and store.match(gone[0], 1.0) == 0
        assert read_all(store, live[0]) == ([BLOCK] * 30, 0)
        clock.advance(600)                        # at 850: beyond 700, within the refreshed 1050
        assert store.exists(live[0][-1:]) == [True]
        assert store.gc().expired == 10   # indexed as they were, then counted by gc
        assert store.stats().per_namespace == {"tenant": 30}
        assert store.verify(orphan_age_s=1e9).bad == 0


def test_hot_paths_never_list_a_directory(tmp_path, clock, monkeypatch):
    keys, blocks = chain(20)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        def refuse(*_a, **_k):
            raise AssertionError("a hot path listed a directory")

        for name in ("listdir", "scandir", "walk"):
            monkeypatch.setattr(os, name, refuse)
        put_in_segments(store, keys, blocks, 5)
        assert store.match(keys, 100) == 20 and store.exists(keys) == [True] * 20
        assert read_all(store, keys) == ([BLOCK] * 20, 0)
        clock.advance(200)
        assert store.gc().expired == 20


def test_check_is_not_blocked_by_a_writer_holding_the_index(tmp_path):
    keys, blocks = chain(16)
    with LmdbStore(tmp_path, fsync=False) as store:
        put(store, keys, blocks, ttl_s=1000)
    code = ("import sys, time; from kvledger.store.lmdb_store import LmdbStore\n"
            "s = LmdbStore(sys.argv[1], fsync=False)\n"
            "with s.index.env.begin(write=True):\n    print('holding', flush=True); time.sleep(3)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with LmdbStore(tmp_path, fsync=False) as store:
            t = time.perf_counter()
            assert store.match(keys, 1000) == 16 and read_all(store, keys) == ([BLOCK] * 16, 0)
            assert time.perf_counter() - t < 1.5, "a CHECK or read waited for the writer"
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()


FULL_DISK = """
import resource, signal, sys
from kvledger.store.ledger import BlockLedger
from tests.store.conftest import chain
led = BlockLedger.open(path=sys.argv[1], fsync=False)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard))  # files past 20 kB fail with EFBIG, like a full disk
keys, blocks = chain(8)
print(tuple(led.put_chain(keys, blocks)), led.store.counters.put_failures, led.match(keys), flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))   # space again: the store works on
print(tuple(led.put_chain(keys, blocks)), led.match(keys), led.read_prefix(keys, [bytearray(4096) for _ in keys]))
"""


def test_full_disk_fails_soft_then_recovers(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["(0, 0, 8) 1 0", "(8, 0, 0) 8 8"]
    assert "put of 8 blocks" in out.stderr  # logged
    assert not list((tmp_path / "tmp").iterdir())  # the cut-short segment was removed


def test_a_lost_or_unreadable_index_is_rebuilt_from_the_segments(tmp_path, clock):
    keys, blocks = chain(30)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        put_in_segments(store, keys, blocks, 8, ttl_s=1000)
    import shutil

    shutil.rmtree(tmp_path / "index.lmdb")
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.match(keys, 1.0) == 30 and read_all(store, keys) == ([BLOCK] * 30, 0)
    (tmp_path / "index.lmdb" / "data.mdb").write_bytes(b"\x00" * 4096 * 4)   # garbage where the index was
    with LmdbStore(tmp_path, fsync=False, clock=clock) as store:
        assert store.match(keys, 1.0) == 30 and store.stats().segments == 4
    assert len(list(tmp_path.glob("index.lmdb.bad-*"))) == 1


def test_two_stores_on_one_directory_in_one_process_share_the_index(tmp_path, clock):
    # LMDB refuses to open one environment twice in a process; the vLLM connector's scheduler and
    # worker sides (or an entrypoint beside an engine) open the same store: both must work.
    keys, blocks = chain(6)
    first = LmdbStore(tmp_path, clock=clock, fsync=False)
    second = LmdbStore(tmp_path, clock=clock, fsync=False)
    put(first, keys, blocks)
    assert second.match(keys, 100.0) == 6
    first.close()  # the other user keeps the environment open
    first.index.close()  # idempotent
    assert second.match(keys, 100.0) == 6 and read_all(second, keys) == ([BLOCK] * 6, 0)
    second.close()
    third = LmdbStore(tmp_path, clock=clock, fsync=False)  # reopened after the last user closed it
    assert third.match(keys, 100.0) == 6
    third.close()
