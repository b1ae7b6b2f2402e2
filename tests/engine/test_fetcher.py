"""The fetcher process: blocks into shared memory (a staging area, or scattered over a pool's layers), checksums
verified, a killed process restarted."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvledger.engine.fetch_target import StagingTarget
from kvledger.engine.fetcher import Fetcher
from kvledger.engine.shared_area import SharedArea
from kvledger.store.ledger import BlockLedger
from tests.engine.helpers import flip_byte_of_block

BB = 4096
KEYS = [bytes([i + 1]) * 16 for i in range(6)]


@pytest.fixture
def setup(tmp_path):
    ledger = BlockLedger.open(path=tmp_path, fsync=False)
    blocks = [np.full(BB, i + 1, np.uint8) for i in range(len(KEYS))]
    ledger.put_chain(KEYS, blocks)
    fetcher = _staged(ledger, timeout_s=5.0)
    yield ledger, fetcher, blocks
    fetcher.close()
    fetcher.target.area.close()
    ledger.close()


def _staged(ledger, block_bytes=BB, capacity=8, **kw) -> Fetcher:
    """A fetcher over a staging area of `capacity` blocks (`target`: its rows; `submit(keys)` takes a run of them)."""
    target = StagingTarget(block_bytes, capacity)
    fetcher = Fetcher(ledger, target.area, target.parts, **kw)
    fetcher.target = target
    return fetcher


def submit(fetcher, keys):
    rows = fetcher.target.rows(keys)
    return None if rows is None else fetcher.submit(keys, rows)


def release(fetcher, job):
    fetcher.release(job)
    fetcher.target.release(job, orphaned=False)


def view(fetcher, job):
    return fetcher.target.staged(job, job.n)


def _wait(fetcher, job):
    deadline = time.monotonic() + 30
    while not job.done and time.monotonic() < deadline:
        fetcher.poll(0.1)
    assert job.done


def test_fetch_into_shared_memory(setup):
    _, fetcher, blocks = setup
    job = submit(fetcher, KEYS[:4])
    _wait(fetcher, job)
    assert job.intact == 4 and all((view(fetcher, job)[i] == blocks[i]).all() for i in range(4))
    assert submit(fetcher, KEYS) is None  # 4 + 6 > 8 staging blocks: wait for a release
    release(fetcher, job)
    assert submit(fetcher, KEYS) is not None


def test_missing_block_stops_the_intact_prefix(setup):
    _, fetcher, _ = setup
    job = submit(fetcher, KEYS[:2] + [b"\x77" * 16] + KEYS[3:5])
    _wait(fetcher, job)
    assert job.intact == 2


def test_killed_process_is_restarted(setup):
    _, fetcher, _ = setup
    pid = fetcher.pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    job = submit(fetcher, KEYS[:3])
    _wait(fetcher, job)
    assert job.intact == 0 and fetcher.restarts == 1 and fetcher.pid != pid
    release(fetcher, job)
    job = submit(fetcher, KEYS[:3])
    _wait(fetcher, job)
    assert job.intact == 3


def _wait_ready(fetcher):
    deadline = time.monotonic() + 30
    while not fetcher.ready and time.monotonic() < deadline:
        fetcher.poll(0.1)
    assert fetcher.ready


def test_hung_process_hits_the_deadline(setup):
    _, fetcher, _ = setup
    fetcher.timeout_s = 0.5
    _wait_ready(fetcher)   # hung with its store open (one hung while opening: the next tests)
    os.kill(fetcher.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    job = submit(fetcher, KEYS[:2])
    _wait(fetcher, job)
    assert job.intact == 0 and fetcher.restarts == 1 and time.monotonic() - t0 < 10


def test_a_job_reports_the_bytes_it_read_and_its_misses_by_cause(setup):
    """What the fetcher process's store saw comes back with the job: the server cannot read its counters."""
    ledger, fetcher, _ = setup
    job = submit(fetcher, KEYS[:4])
    _wait(fetcher, job)
    assert (job.bytes_read, job.misses) == (4 * BB, {})
    release(fetcher, job)
    job = submit(fetcher, KEYS[:2] + [b"\x77" * 16] + KEYS[3:5])
    _wait(fetcher, job)
    assert (job.intact, job.bytes_read, job.misses) == (2, 4 * BB, {"absent": 1})   # blocks after a gap still read
    fetcher.release(job)
    flip_byte_of_block(ledger.store.root, KEYS[1])
    job = submit(fetcher, KEYS[:3])
    _wait(fetcher, job)
    assert (job.intact, job.bytes_read, job.misses) == (1, 2 * BB, {"corrupt": 1})


def test_the_fetcher_opens_the_cluster_store_of_the_ledger_prefix_included(tmp_path, redis_server):
    """The fetcher process opens the ledger's own location (`store.open.location_of`): the Redis index under the
    ledger's key prefix and the segment files it names, read by location."""
    ledger = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False, prefix="other:")
    blocks = [np.full(BB, i + 1, np.uint8) for i in range(len(KEYS))]
    assert ledger.put_chain(KEYS, blocks).written == 6
    fetcher = _staged(ledger, timeout_s=5.0)
    try:
        job = submit(fetcher, KEYS)
        _wait(fetcher, job)
        assert job.intact == len(KEYS) and all((view(fetcher, job)[i] == blocks[i]).all() for i in range(6))
    finally:
        fetcher.close()
        fetcher.target.area.close()
        ledger.close()


def test_a_job_submitted_while_the_store_opens_gets_its_whole_budget(tmp_path, redis_server):
    """The deadline counts from the fetcher's READY frame, not from the submission: a store that takes long to
    open (Redis pausing writes for 1.5 s holds its volume check) costs the first job nothing. Before, a job's
    0.8 s deadline started at once: the fetcher was killed while opening and the job read as 0 intact."""
    import redis

    ledger = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    blocks = [np.full(BB, i + 1, np.uint8) for i in range(len(KEYS))]
    assert ledger.put_chain(KEYS, blocks).written == 6
    redis.Redis.from_url(redis_server.url).execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    fetcher = _staged(ledger, timeout_s=0.5)
    try:
        job = submit(fetcher, KEYS)
        assert not fetcher.ready
        _wait(fetcher, job)
        assert (job.intact, fetcher.restarts) == (6, 0) and job.fetch_s > 1.0
        assert all((view(fetcher, job)[i] == blocks[i]).all() for i in range(6))
        assert fetcher.ready_at - fetcher.spawned > 1.0   # the open was slow indeed
    finally:
        fetcher.close()
        fetcher.target.area.close()
        ledger.close()


def test_a_fetcher_that_hangs_while_opening_is_killed_after_the_open_timeout(setup):
    """Counting from READY must not wait forever: a fetcher stopped before it opened its store is killed
    `open_timeout_s` (plus the job's budget) after its start, its job read as 0 intact, and a new one serves."""
    ledger, _, _ = setup
    fetcher = _staged(ledger, timeout_s=0.5, open_timeout_s=1.0)
    try:
        os.kill(fetcher.pid, signal.SIGSTOP)
        job = submit(fetcher, KEYS[:2])
        _wait(fetcher, job)
        assert (job.intact, fetcher.restarts) == (0, 1)
        assert 1.0 < job.fetch_s < 10
        release(fetcher, job)
        job = submit(fetcher, KEYS[:2])
        _wait(fetcher, job)
        assert job.intact == 2 and fetcher.ready
    finally:
        fetcher.close()
        fetcher.target.area.close()


def _mapped_kib(pid: int, name: str) -> int:
    """Resident KiB of the mappings of memfd `name` in process `pid` (its smaps entries)."""
    rss, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:   # a mapping's header: "start-end perms offset dev inode path"
            inside = f"/memfd:{name} " in line
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


def test_a_fresh_fetcher_maps_the_whole_staging_area_before_its_first_job(tmp_path):
    """Its first hit does not pay for mapping the pages (a 94 MB fetch: 39 ms, against 9 once they are mapped)."""
    ledger = BlockLedger.open(path=tmp_path, fsync=False)
    fetcher = _staged(ledger, 64 << 10, 64)   # 4 MiB
    try:
        deadline = time.monotonic() + 30
        while not fetcher.ready and time.monotonic() < deadline:
            fetcher.poll(0.1)
        assert fetcher.ready and not fetcher.jobs
        assert _mapped_kib(fetcher.pid, "kvledger-staging") >= 4096
    finally:
        fetcher.close()
        fetcher.target.area.close()
        ledger.close()


@pytest.mark.parametrize("by_part", [False, True])
def test_blocks_go_straight_into_their_rows_of_every_part(tmp_path, by_part):
    """The pool's layout (`PoolTarget`): a block's bytes split over parts of unequal size (the layers), block i into
    row rows[i] of each; rows in any order, and the rows of no job untouched. A checksum covers all the parts: a
    corrupt block stops the intact prefix there. Read part by part (a streamed hit), the same; and once
    `wait_parts(job, k)` returns, parts [0, k) of every block are in their rows (`parts_done`)."""
    ledger = BlockLedger.open(path=tmp_path, fsync=False)
    blocks = list(np.random.default_rng(3).integers(1, 256, (len(KEYS), BB), dtype=np.uint8))  # no zero byte
    ledger.put_chain(KEYS, blocks)
    parts = [(0, 1000), (8 * 1000, 96), (8 * 1096, BB - 1096)]   # 3 parts, 8 rows each
    area = SharedArea(8 * BB)
    fetcher = Fetcher(ledger, area, parts, timeout_s=5.0)
    try:
        u8 = np.frombuffer(area.buf, np.uint8)

        def block_at(row):
            return np.concatenate([u8[base + row * size: base + (row + 1) * size] for base, size in parts])

        job = fetcher.submit(KEYS[:3], [5, 0, 6], by_part=by_part)
        if by_part:
            for k, (base, size) in enumerate(parts, 1):
                assert fetcher.wait_parts(job, k, 30.0) and fetcher.parts_done(job) >= k
                lo = sum(s for _, s in parts[:k - 1])   # part k - 1's bytes in a ledger block
                assert all((u8[base + row * size: base + (row + 1) * size] == blocks[i][lo:lo + size]).all()
                           for i, row in enumerate([5, 0, 6]))
        _wait(fetcher, job)
        assert fetcher.parts_done(job) == len(parts)
        assert (job.intact, job.bytes_read) == (3, 3 * BB)
        assert all((block_at(row) == blocks[i]).all() for i, row in enumerate([5, 0, 6]))
        assert all(not block_at(row).any() for row in range(8) if row not in (5, 0, 6))
        flip_byte_of_block(ledger.store.root, KEYS[4])
        job = fetcher.submit(KEYS[3:6], [1, 2, 3], by_part=by_part)
        _wait(fetcher, job)
        assert (job.intact, job.misses) == (1, {"corrupt": 1}) and (block_at(1) == blocks[3]).all()
    finally:
        fetcher.close()
        area.close()
        ledger.close()
