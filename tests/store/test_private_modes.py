"""Whoever's process writes the ledgers, their folders are 0700 and their files 0600 whatever its umask (DESIGN;
issue 54 item 4): the block ledger embedded (segments, LMDB index and lock) and in cluster mode (segments and
the volume id on the shared folder), and the state ledger's snapshot files. Under umask 022 each was 0755 / 0644
when written by anything but the `kvledger` commands (which set umask 077): a library user such as vLLM."""

from __future__ import annotations

from kvledger.state.files import SnapshotFiles
from kvledger.store.ledger import BlockLedger
from tests.entrypoint.test_private_files import exposed, umask

from .conftest import chain


def test_an_embedded_block_ledger_and_snapshot_files_written_under_umask_022_are_private(tmp_path):
    keys, blocks = chain(6, seed=5)
    with umask(0o022):
        with BlockLedger.open(tmp_path / "store", fsync=False) as ledger:
            assert ledger.put_chain(keys[:3], blocks[:3]).written == 3
            assert ledger.put_chain(keys[3:], blocks[3:], start_pos=3, parent=keys[2]).written == 3
        SnapshotFiles(tmp_path / "store").write(keys[2], 384, b"w" * 4096)
    names = {p.name for p in (tmp_path / "store").rglob("*")}
    assert {"data.mdb", "lock.mdb", ".lock"} <= names and any(n.endswith(".kvs") for n in names)
    assert any(n.endswith(".snap") for n in names)
    assert exposed(tmp_path / "store") == []


def test_a_cluster_block_ledger_written_under_umask_022_is_private(tmp_path, redis_server):
    keys, blocks = chain(4, seed=6)
    with umask(0o022), BlockLedger.open(tmp_path / "mount" / "kvl", redis_server.url, fsync=False) as ledger:
        assert ledger.put_chain(keys, blocks).written == 4
    assert any(p.suffix == ".kvs" for p in (tmp_path / "mount").rglob("*"))
    assert exposed(tmp_path / "mount") == []
