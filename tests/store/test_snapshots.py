"""Snapshot files follow the block ledger: removed with their chain block, counted in `store stats`."""

from __future__ import annotations

import json
import os
import time

from kvledger.state.files import SnapshotFiles
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.ledger import BlockLedger
from kvledger.store.snapshots import collect_snapshots, snapshot_stats
from kvledger.store.ttl import DAY_S, TtlPolicy

from .conftest import chain

PAYLOAD = b"w" * 1000


def _write(root, key: bytes, position: int, age_s: float = 120.0) -> None:
    files = SnapshotFiles(root)
    files.write(key, position, PAYLOAD)
    then = time.time() - age_s
    os.utime(files.path(key), (then, then))


def test_snapshots_go_with_their_chain_block_on_every_backend(store, tmp_path):
    led = BlockLedger(store)
    keys, blocks = chain(6)
    led.put_chain(keys, blocks)
    for i in (1, 3, 5):
        _write(tmp_path, keys[i], (i + 1) * 128)
    _write(tmp_path, bytes(range(16)), 128)                  # its block was never stored
    _write(tmp_path, bytes(range(1, 17)), 128, age_s=0.0)    # ...but it is new: spared (grace)
    assert snapshot_stats(tmp_path) == (5, 5 * (1000 + 32))
    assert led.delete(keys[4:]) == 2
    res = collect_snapshots(tmp_path, store)
    assert res == (2, 2 * 1032)  # keys[5]'s and the old orphan's
    files = SnapshotFiles(tmp_path)
    assert files.read(keys[1]) is not None and files.read(keys[3]) is not None
    assert files.read(keys[5]) is None and files.exists(bytes(range(1, 17)))
    assert collect_snapshots(tmp_path, store) == (0, 0)


def test_store_gc_removes_snapshots_of_expired_chains_and_stats_count_them(tmp_path, run_cli):
    short, long_ = chain(4, seed=1), chain(4, seed=2)
    with BlockLedger(LmdbStore(tmp_path, fsync=False), TtlPolicy.parse(f"blink={1 / DAY_S}")) as led:
        led.put_chain(*short, ttl_class="blink")   # the agent-like chain: gone in 1 s
        led.put_chain(*long_)                      # chatbot: 7 days
    born = time.monotonic()
    for keys in (short[0], long_[0]):
        _write(tmp_path, keys[1], 256)
        _write(tmp_path, keys[3], 512)
    r = run_cli("store", "stats", "--path", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert (st["snapshots"], st["snapshot_bytes"]) == (4, 4 * 1032)
    time.sleep(max(0.0, 1.2 - (time.monotonic() - born)))
    r = run_cli("store", "gc", "--path", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["snapshots_removed"] == 2 and res["snapshot_bytes_freed"] == 2 * 1032
    files = SnapshotFiles(tmp_path)
    assert not files.exists(short[0][1]) and not files.exists(short[0][3])
    assert files.read(long_[0][1]) == (256, bytearray(PAYLOAD))
    st = json.loads(run_cli("store", "stats", "--path", str(tmp_path), "--json").stdout)
    assert st["snapshots"] == 2
