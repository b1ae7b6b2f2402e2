"""What a real `kvledger serve` and `kvledger up` write is their user's alone: no file or folder under the
data dir is readable (or writable) by group or others, whatever umask they were started with (the raw KV
bytes, the salted namespace names in index.lmdb, Redis's dump.rdb, the logs, the cluster token)."""

from __future__ import annotations

import stat
from pathlib import Path

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.serve_process import ServeProcess, request
from tests.support import umask

PROMPT = list(range(1, 400))   # 3 full blocks stored (tiny-v4), and its two snapshots


def exposed(root: Path) -> list[str]:
    """Every path under `root` (itself included) whose mode gives group or others any access."""
    out = []
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
            out.append(f"{stat.S_IMODE(st.st_mode):04o} {path.relative_to(root.parent)}")
    return out


def complete(url: str) -> None:
    status, raw = request(url + "/v1/completions", b'{"model": "tiny-v4", "prompt": %s, "max_tokens": 2}'
                          % str(PROMPT).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw


def test_serve_writes_nothing_group_or_others_can_read(tmp_path):
    data = tmp_path / "data"
    with umask(0o022):
        server = ServeProcess(data, model="tiny-v4").start()
    try:
        complete(server.url)
    finally:
        assert server.stop() == 0
    assert any(p.suffix == ".kvs" for p in data.rglob("*")) and (data / "blocks" / "index.lmdb").is_dir()
    assert exposed(data) == []


def test_up_writes_nothing_group_or_others_can_read(tmp_path):
    data = tmp_path / "cluster"
    with umask(0o022):
        cluster = ClusterProcess(data, prefill=0, decode=0, both=1, model="tiny-v4").start()
    try:
        complete(cluster.url)
    finally:
        assert cluster.stop() == 0
    names = {p.name for p in data.rglob("*")}
    assert {"cluster.token", "dump.rdb", "entrypoint.log", "both-0.log"} <= names, names
    assert any(p.suffix == ".kvs" for p in data.rglob("*"))
    assert exposed(data) == []
