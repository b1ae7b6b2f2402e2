"""The fetcher process: blocks into shared memory, checksums verified, a killed process restarted."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvledger.engine.fetcher import Fetcher
from kvledger.store.ledger import BlockLedger
from tests.engine.helpers import flip_byte_of_block

BB = 4096
KEYS = [bytes([i + 1]) * 16 for i in range(6)]


@pytest.fixture
def setup(tmp_path):
    ledger = BlockLedger.open(path=tmp_path, fsync=False)
    blocks = [np.full(BB, i + 1, np.uint8) for i in range(len(KEYS))]
    ledger.put_chain(KEYS, blocks)
    fetcher = Fetcher(ledger, BB, 8, timeout_s=5.0)
    yield ledger, fetcher, blocks
    fetcher.close()
    ledger.close()


def _wait(fetcher, job):
    deadline = time.monotonic() + 30
    while not job.done and time.monotonic() < deadline:
        fetcher.poll(0.1)
    assert job.done


def test_fetch_into_shared_memory(setup):
    _, fetcher, blocks = setup
    job = fetcher.submit(KEYS[:4])
    _wait(fetcher, job)
    assert job.intact == 4 and all((fetcher.view(job)[i] == blocks[i]).all() for i in range(4))
    assert fetcher.submit(KEYS) is None  # 4 + 6 > 8 staging blocks: wait for a release
    fetcher.release(job)
    assert fetcher.submit(KEYS) is not None


def test_missing_block_stops_the_intact_prefix(setup):
    _, fetcher, _ = setup
    job = fetcher.submit(KEYS[:2] + [b"\x77" * 16] + KEYS[3:5])
    _wait(fetcher, job)
    assert job.intact == 2


def test_killed_process_is_restarted(setup):
    _, fetcher, _ = setup
    pid = fetcher.pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    job = fetcher.submit(KEYS[:3])
    _wait(fetcher, job)
    assert job.intact == 0 and fetcher.restarts == 1 and fetcher.pid != pid
    fetcher.release(job)
    job = fetcher.submit(KEYS[:3])
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
    job = fetcher.submit(KEYS[:2])
    _wait(fetcher, job)
    assert job.intact == 0 and fetcher.restarts == 1 and time.monotonic() - t0 < 10


def test_a_job_reports_the_bytes_it_read_and_its_misses_by_cause(setup):
    """What the fetcher process's store saw comes back with the job: the server cannot read its counters."""
    ledger, fetcher, _ = setup
    job = fetcher.submit(KEYS[:4])
    _wait(fetcher, job)
    assert (job.bytes_read, job.misses) == (4 * BB, {})
    fetcher.release(job)
    job = fetcher.submit(KEYS[:2] + [b"\x77" * 16] + KEYS[3:5])
    _wait(fetcher, job)
    assert (job.intact, job.bytes_read, job.misses) == (2, 4 * BB, {"absent": 1})   # blocks after a gap still read
    fetcher.release(job)
    flip_byte_of_block(ledger.store.root, KEYS[1])
    job = fetcher.submit(KEYS[:3])
    _wait(fetcher, job)
    assert (job.intact, job.bytes_read, job.misses) == (1, 2 * BB, {"corrupt": 1})


def test_the_fetcher_opens_the_cluster_store_of_the_ledger_prefix_included(tmp_path, redis_server):
    """The fetcher process opens the ledger's own location (`store.open.location_of`): the Redis index under the
    ledger's key prefix and the segment files it names, read by location."""
    ledger = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False, prefix="other:")
    blocks = [np.full(BB, i + 1, np.uint8) for i in range(len(KEYS))]
    assert ledger.put_chain(KEYS, blocks).written == 6
    fetcher = Fetcher(ledger, BB, 8, timeout_s=5.0)
    try:
        job = fetcher.submit(KEYS)
        _wait(fetcher, job)
        assert job.intact == len(KEYS) and all((fetcher.view(job)[i] == blocks[i]).all() for i in range(6))
    finally:
        fetcher.close()
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
    fetcher = Fetcher(ledger, BB, 8, timeout_s=0.5)
    try:
        job = fetcher.submit(KEYS)
        assert not fetcher.ready
        _wait(fetcher, job)
        assert (job.intact, fetcher.restarts) == (6, 0) and job.fetch_s > 1.0
        assert all((fetcher.view(job)[i] == blocks[i]).all() for i in range(6))
        assert fetcher.ready_at - fetcher.spawned > 1.0   # the open was slow indeed
    finally:
        fetcher.close()
        ledger.close()


def test_a_fetcher_that_hangs_while_opening_is_killed_after_the_open_timeout(setup):
    """Counting from READY must not wait forever: a fetcher stopped before it opened its store is killed
    `open_timeout_s` (plus the job's budget) after its start, its job read as 0 intact, and a new one serves."""
    ledger, _, _ = setup
    fetcher = Fetcher(ledger, BB, 8, timeout_s=0.5, open_timeout_s=1.0)
    try:
        os.kill(fetcher.pid, signal.SIGSTOP)
        job = fetcher.submit(KEYS[:2])
        _wait(fetcher, job)
        assert (job.intact, fetcher.restarts) == (0, 1)
        assert 1.0 < job.fetch_s < 10
        fetcher.release(job)
        job = fetcher.submit(KEYS[:2])
        _wait(fetcher, job)
        assert job.intact == 2 and fetcher.ready
    finally:
        fetcher.close()


def _mapped_kib(pid: int, shm_name: str) -> int:
    """Resident KiB of the mapping of /dev/shm/`shm_name` in process `pid` (its smaps entry)."""
    rss, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:   # a mapping's header: "start-end perms offset dev inode path"
            inside = line.rstrip().endswith(shm_name)
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


def test_a_fresh_fetcher_maps_the_whole_staging_area_before_its_first_job(tmp_path):
    """Its first hit does not pay for mapping the pages (a 94 MB fetch: 39 ms, against 9 once they are mapped)."""
    ledger = BlockLedger.open(path=tmp_path, fsync=False)
    fetcher = Fetcher(ledger, 64 << 10, 64)   # 4 MiB
    try:
        deadline = time.monotonic() + 30
        while not fetcher.ready and time.monotonic() < deadline:
            fetcher.poll(0.1)
        assert fetcher.ready and not fetcher.jobs
        assert _mapped_kib(fetcher.pid, fetcher.shm.name) >= 4096
    finally:
        fetcher.close()
        ledger.close()
