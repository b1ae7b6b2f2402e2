"""The fetcher process: blocks into shared memory, checksums verified, a killed process restarted."""

import os
import signal
import time

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


def test_hung_process_hits_the_deadline(setup):
    _, fetcher, _ = setup
    fetcher.timeout_s = 0.5
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
