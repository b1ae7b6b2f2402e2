"""Faults across processes: concurrent writers of one chain (Redis), GC racing reads (embedded store). Kill -9
mid-write and concurrent writers of the embedded store: test_scale_faults.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from kvledger.store import segment as sg
from kvledger.store.backend import ChainWrite
from kvledger.store.lmdb_store import LmdbStore

from .conftest import BLOCK, chain

REPO = Path(__file__).parents[2]

SAME_CHAIN = """
import json, os, sys, time
from kvledger.store.ledger import BlockLedger
from tests.store.conftest import chain
where, go = sys.argv[1], sys.argv[2]
led = BlockLedger.open(redis_url=where) if where.startswith("redis://") else BlockLedger.open(path=where, fsync=False)
keys, blocks = chain(200, seed=42)
deadline = time.time() + 60  # never outlive a failed test
while not os.path.exists(go):
    if time.time() > deadline:
        sys.exit(3)
    time.sleep(0.001)
print(json.dumps(tuple(led.put_chain(keys, blocks))))
"""

READER = """
import json, os, sys, time
from kvledger.store.ledger import BlockLedger
from tests.store.conftest import chain, block_of, BLOCK
where, n_chains, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
until = time.time() + 120  # safety net: the test touches `stop` when it is done
led = BlockLedger.open(redis_url=where) if where.startswith("redis://") else BlockLedger.open(path=where, fsync=False)
keys = [k for s in range(n_chains) for k in chain(20 if n_chains > 1 else 200, seed=s if n_chains > 1 else 42)[0]]
hits = misses = wrong = rounds = mixed = 0
while not os.path.exists(stop) and time.time() < until:
    bufs = [bytearray(BLOCK) for _ in keys]
    sizes = led.get_into(keys, bufs)
    for k, b, size in zip(keys, bufs, sizes):
        if size < 0:
            misses += 1
        elif bytes(b) != block_of(k):
            wrong += 1
        else:
            hits += 1
    rounds += 1
    mixed += 0 < sizes.count(-1) < len(sizes)  # a round that saw the store partway through a change
    if rounds == 1:
        print("ready", flush=True)
print(json.dumps({"hits": hits, "misses": misses, "wrong": wrong, "rounds": rounds, "mixed": mixed}), flush=True)
"""


_SPAWNED: list[subprocess.Popen] = []


def py(code: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _SPAWNED.append(p)
    return p


@pytest.fixture(autouse=True)
def _reap():
    """Kill whatever a test started and left running (a failed assertion must not leave processes)."""
    yield
    while _SPAWNED:
        p = _SPAWNED.pop()
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def _same_chain(where: str, tmp_path: Path, n_writers: int = 3) -> list[tuple[int, int, int]]:
    go, stop = tmp_path / "go", tmp_path / "stop"
    reader = py(READER, where, "1", str(stop))
    writers = [py(SAME_CHAIN, where, str(go)) for _ in range(n_writers)]
    assert reader.stdout.readline().strip() == "ready"
    go.touch()
    results = []
    for w in writers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        results.append(tuple(json.loads(out)))
    time.sleep(0.2)  # let the reader see the finished chain
    stop.touch()
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["wrong"] == 0 and seen["hits"] > 0  # no torn read, ever
    return results


def test_concurrent_writers_of_one_chain_redis(tmp_path, redis_server):
    results = _same_chain(redis_server.url, tmp_path)
    assert sum(r[0] for r in results) == 200 and all(r[2] == 0 for r in results)
    r = redis.Redis.from_url(redis_server.url)
    assert r.dbsize() == 200 + 200 + 2   # each block once, with its tombstone; its bucket's totals and set
    assert int(r.hget("kvl:u:", "t")) == 200 * BLOCK and r.zcard(r.keys("kvl:z:*")[0]) == 200   # counted once


def test_gc_racing_reads_in_another_process_is_a_miss_never_an_error(tmp_path, clock):
    store = LmdbStore(tmp_path, fsync=False, clock=clock)
    n_chains = 30
    for s in range(n_chains):
        keys, blocks = chain(20, seed=s)
        store.put(ChainWrite(keys, blocks, 0, bytes(16), "default", "agent", 100.0 + s))  # one chain a second
    stop = tmp_path.parent / f"{tmp_path.name}-stop"
    reader = py(READER, str(tmp_path), str(n_chains), str(stop))
    assert reader.stdout.readline().strip() == "ready"
    clock.advance(100.5)
    removed = 0
    for _ in range(n_chains):  # one chain per GC pass, in small batches, spread over time, while the reader reads
        removed += store.gc(batch=7).expired
        clock.advance(1)
        time.sleep(0.05)
    assert removed == 20 * n_chains and list((tmp_path / "segments").rglob("*" + sg.SUFFIX)) == []
    time.sleep(0.2)
    stop.touch()
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["wrong"] == 0 and seen["hits"] >= 600 and seen["misses"] > 0
    assert seen["mixed"] >= 1, "no read overlapped the GC"  # some blocks gone, others still read: mid-GC
