import os
import subprocess
import sys
from pathlib import Path

import pytest

KVLEDGER = Path(sys.executable).parent / "kvledger"

# Every server, engine and bench the suite starts computes on one torch thread, whatever the machine: the
# suite runs many small ones beside its own driver, where more threads only wait for each other (a reference
# check took 45 s at 2 threads and 21 s at 1 on 2 cores). A test that means another count passes --threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def run_cli():
    """Run the installed `kvledger` console script; returns the CompletedProcess (text). `env`: variables
    set on top of this process's environment (e.g. XDG_DATA_HOME, which moves serve's default data dir)."""

    def run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(KVLEDGER), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})

    return run


@pytest.fixture
def redis_server():
    """A real redis-server of this test's own on a free loopback port (stopped after the test)."""
    from kvledger.util.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def shared_redis():
    """One real redis-server for the whole session, for tests that only read and write keys."""
    from kvledger.util.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """One real 3-master Redis Cluster for the whole session (`.url` is a redis+cluster:// URL); tests
    keep apart by key prefix. Tests that kill a node start their own RedisCluster."""
    from kvledger.util.redis_cluster import RedisCluster

    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def juicefs(tmp_path):
    """A real JuiceFS volume of this test's own: metadata on a redis-server of its own (not the one a test
    keeps kvledger's index on), data under tmp_path/jfs/objects; `juicefs.mount(path)` adds a client (a
    "machine"), all unmounted after the test. Skipped, saying why, where FUSE or juicefs is unavailable."""
    from kvledger.util.juicefs import JuiceFS, fuse_unavailable
    from kvledger.util.redis_server import RedisServer

    if (why := fuse_unavailable()) is not None:
        pytest.skip(why)
    with RedisServer() as meta, JuiceFS(tmp_path / "jfs", meta.url.rsplit("/", 1)[0] + "/1") as volume:
        yield volume
