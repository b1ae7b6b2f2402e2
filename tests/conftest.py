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


INTEGRATIONS = "tests/integrations/"   # the vLLM tests: each starts vLLM, which takes a core and gigabytes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The vLLM tests go first, so under two workers (`make test`) the longest scope starts at once, not last."""
    items.sort(key=lambda item: not item.nodeid.startswith(INTEGRATIONS))   # stable: the others keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`make test`: `-n 2 --dist loadfile`) each test file runs whole and in order on one worker,
    as in a serial run: a file's module fixtures (an engine, a server) are built once, and a test finds them as the
    tests before it left them. tests/integrations/ is one scope, so one worker runs the vLLM tests one after the
    other. (pytest-xdist's `loadgroup` cannot do this under pytest 9.2: it renames `item._nodeid`, which pytest 9.2
    no longer reads, so its groups are ignored and files split across workers.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return INTEGRATIONS if nodeid.startswith(INTEGRATIONS) else super()._split_scope(nodeid)

    return FileScheduling(config, log)


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
