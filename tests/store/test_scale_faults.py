"""Crash safety of the persisted index (issue 3's fault tests on LmdbStore): kill -9 during puts, GC and
compaction leaves 0 wrong bytes and loses 0 acknowledged blocks; concurrent writers of one chain."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.store.backend import ChainWrite
from kvledger.store.lmdb_store import LmdbStore

from .conftest import BLOCK, block_of, chain

REPO = Path(__file__).parents[2]

WRITER = """
import sys, time
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.backend import ChainWrite
from tests.store.conftest import chain, block_of
store = LmdbStore(sys.argv[1], fsync=True)
print("up", flush=True)
seed = int(sys.argv[2]) * 1000
deadline = time.time() + 60  # killed from outside long before; never outlive a failed test
while time.time() < deadline:
    keys, _ = chain(48, namespace="kill", seed=seed)
    blocks = [block_of(k, 65536) for k in keys]
    for s in range(0, 48, 16):
        r = store.put(ChainWrite(keys[s:s + 16], blocks[s:s + 16], s, keys[s - 1] if s else bytes(16), "kill",
                                 "agent", 1e6))
        assert r.failed == 0
    print(seed, flush=True)   # acknowledged: every put of this chain returned
    seed += 1
"""

UPKEEP = """
import sys, time
from kvledger.store.lmdb_store import LmdbStore
store = LmdbStore(sys.argv[1], fsync=True, clock=lambda: time.time() + float(sys.argv[2]))
print("up", flush=True)
store.gc(batch=int(sys.argv[3]))
print("done", flush=True)
time.sleep(60)
"""

_SPAWNED: list[subprocess.Popen] = []


def py(code: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _SPAWNED.append(p)
    return p


@pytest.fixture(autouse=True)
def _reap():
    yield
    while _SPAWNED:
        p = _SPAWNED.pop()
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def _kill_after(p: subprocess.Popen, seconds: float) -> list[str]:
    """Wait for "up", let it run, kill -9; the lines it printed."""
    assert p.stdout.readline().strip() == "up"
    time.sleep(seconds)
    p.kill()
    out = p.stdout.read().split()
    p.wait(timeout=10)
    return out


def _all_indexed_read_back(store: LmdbStore, size: int) -> int:
    """Every block the index holds reads back its own bytes; the number of blocks."""
    with store.index.env.begin() as txn:
        keys = [bytes(k) for k, _ in txn.cursor(db=store.index.blocks)]
    bufs = [bytearray(size) for _ in keys]
    assert store.get_into(keys, bufs) == [size] * len(keys), "an indexed block without its bytes"
    assert all(bytes(b) == block_of(k, size) for k, b in zip(keys, bufs)), "wrong bytes"
    return len(keys)


def test_kill_9_during_puts_loses_no_acknowledged_block(tmp_path):
    rng = random.Random(5)
    acked: list[int] = []
    for rnd in range(6):
        acked += [int(s) for s in _kill_after(py(WRITER, str(tmp_path), str(rnd)), 0.3 + rng.random() * 0.6)]
    assert acked, "no chain was acknowledged"
    with LmdbStore(tmp_path, fsync=False) as store:
        assert not list((tmp_path / "tmp").iterdir()), "writes cut short were removed at open"
        for seed in acked:
            keys, _ = chain(48, namespace="kill", seed=seed)
            assert store.match(keys, 1.0) == 48, f"acknowledged chain {seed} lost"
        assert _all_indexed_read_back(store, 65536) >= 48 * len(acked)
        assert store.verify().bad == 0


def _populate(root: Path, n_keep: int, n_expire: int, per_put: int) -> tuple[list, list]:
    keep, expire = [], []
    with LmdbStore(root, fsync=False) as store:
        for i in range(n_keep + n_expire):
            keys, blocks = chain(16, seed=100 + i)
            ttl = 1e6 if i < n_keep else 100.0
            for s in range(0, 16, per_put):
                store.put(ChainWrite(keys[s:s + per_put], blocks[s:s + per_put], s, keys[s - 1] if s else bytes(16),
                                     "default", "agent", ttl))
            (keep if i < n_keep else expire).append(keys)
    return keep, expire


def test_kill_9_during_gc_loses_no_live_block(tmp_path):
    keep, expire = _populate(tmp_path, 20, 150, per_put=2)   # 1,200 segments of which 1,200 − 160 expire
    rng = random.Random(7)
    for _ in range(3):
        _kill_after(py(UPKEEP, str(tmp_path), "1000", "4"), 0.2 + rng.random() * 0.5)
        with LmdbStore(tmp_path, fsync=False) as store:
            assert all(store.match(k, 1.0) == 16 for k in keep), "GC killed mid-way lost a live block"
            _all_indexed_read_back(store, BLOCK)
    with LmdbStore(tmp_path, fsync=False, clock=lambda: time.time() + 1000) as store:
        store.gc()
        assert store.stats().blocks == 16 * len(keep) and store.verify(orphan_age_s=0).checked == 16 * len(keep)
        assert store.verify(orphan_age_s=0).bad == 0
        assert _all_indexed_read_back(store, BLOCK) == 16 * len(keep)


def test_kill_9_during_compaction_loses_no_live_block(tmp_path):
    with LmdbStore(tmp_path, fsync=False) as store:
        chains = [chain(32, seed=300 + i) for i in range(120)]
        for keys, blocks in chains:
            store.put(ChainWrite(keys, blocks, 0, bytes(16), "default", "agent", 1e6))
            store.delete(keys[4:28])   # 8 of 32 left in each segment: all sparse
    rng = random.Random(9)
    for _ in range(3):
        _kill_after(py(UPKEEP, str(tmp_path), "0", "8"), 0.2 + rng.random() * 0.5)
        with LmdbStore(tmp_path, fsync=False) as store:
            for keys, _ in chains:
                assert store.exists(keys[:4] + keys[28:]) == [True] * 8, "compaction killed mid-way lost a block"
            assert _all_indexed_read_back(store, BLOCK) == 8 * len(chains)
    with LmdbStore(tmp_path, fsync=False) as store:
        store.gc()
        st = store.stats()
        assert st.blocks == 8 * len(chains) and st.disk_bytes < 8 * len(chains) * BLOCK * 2
        first = store.verify(orphan_age_s=0)   # files a kill left between write, commit and unlink: removed
        assert first.checked == 8 * len(chains) and first.bytes_checked == first.checked * BLOCK
        assert store.verify(orphan_age_s=0).bad == 0 and store.stats().blocks == 8 * len(chains)


SAME_CHAIN = """
import json, os, sys, time
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.ledger import BlockLedger
from tests.store.conftest import chain
led = BlockLedger(LmdbStore(sys.argv[1], fsync=False))
keys, blocks = chain(200, seed=42)
deadline = time.time() + 60
while not os.path.exists(sys.argv[2]):
    if time.time() > deadline:
        sys.exit(3)
    time.sleep(0.001)
print(json.dumps(tuple(led.put_chain(keys, blocks))), flush=True)
"""


def test_concurrent_writers_of_one_chain_index_each_block_once(tmp_path):
    root, go = tmp_path / "store", tmp_path / "go"
    LmdbStore(root).close()
    writers = [py(SAME_CHAIN, str(root), str(go)) for _ in range(3)]
    time.sleep(1.0)
    go.touch()
    results = []
    for w in writers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        results.append(json.loads(out))
    assert sum(r[0] for r in results) == 200 and all(r[2] == 0 for r in results)
    with LmdbStore(root, fsync=False) as store:
        keys, _ = chain(200, seed=42)
        assert store.match(keys, 1.0) == 200 and store.stats().blocks == 200
        assert _all_indexed_read_back(store, BLOCK) == 200
        assert store.verify(orphan_age_s=0).bad == 0   # the losers' files were unlinked, not left behind
