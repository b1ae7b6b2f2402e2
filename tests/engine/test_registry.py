"""The engine registry's heartbeat takes an engine out while its store does not read (issue 19 item 3).

A real Redis, a real cluster-mode block ledger (Redis index, segment files in a folder). The folder's
faults are made as a dead or swapped mount makes them: the volume file gone unreadable, another
volume's file in its place, a block read that fails with a local error. A dead FUSE mount (ENOTCONN)
is the JuiceFS variant of the reference check.
"""

from __future__ import annotations

import os
import shutil
import time

from kvledger.engine.registry import EngineInfo, Heartbeat, Registry
from kvledger.store.ledger import BlockLedger
from kvledger.store.redis_backend import VOLUME_FILE

from ..store.conftest import BLOCK, chain


def info() -> EngineInfo:
    return EngineInfo("prefill-0", "prefill", "http://127.0.0.1:1", "tiny-v4", 4096, 100, (0,), os.getpid())


def members(registry: Registry) -> list[str]:
    return [e.engine_id for e in registry.members()]


def test_an_engine_whose_store_does_not_read_leaves_the_registry_and_comes_back(tmp_path, redis_server):
    ledger = BlockLedger.open(path=tmp_path / "blocks", redis_url=redis_server.url)
    registry = Registry.from_url(redis_server.url, prefix="kvl-hb1:")
    beat = Heartbeat(registry, info, ledger.read_fault, hold_s=0.2)
    beat.start()
    try:
        assert members(registry) == ["prefill-0"] and ledger.read_fault() is None
        volume = tmp_path / "blocks" / VOLUME_FILE
        saved = volume.read_text()
        volume.unlink()
        volume.mkdir()   # reads fail (EISDIR) as they would on a dead mount
        beat.beat()
        assert members(registry) == [] and "does not read" in beat.fault_reason
        volume.rmdir()
        volume.write_text("another-volume\n")   # an empty mount point that got some other volume's file
        beat.beat()
        assert members(registry) == [] and "no longer the volume" in beat.fault_reason
        volume.write_text(saved)
        beat.beat()
        assert members(registry) == []   # held out for hold_s after the last fault
        time.sleep(0.25)
        beat.beat()
        assert members(registry) == ["prefill-0"] and beat.fault_reason is None
    finally:
        beat.stop()
        ledger.close()


def test_a_failed_block_read_takes_the_engine_out_and_unpublishes_nothing(tmp_path, redis_server):
    ledger = BlockLedger.open(path=tmp_path / "blocks", redis_url=redis_server.url)
    keys, blocks = chain(4, seed=19)
    assert ledger.put_chain(keys, blocks).written == 4
    registry = Registry.from_url(redis_server.url, prefix="kvl-hb2:")
    beat = Heartbeat(registry, info, ledger.read_fault, hold_s=60)
    beat.start()
    seg_dir = tmp_path / "blocks" / "segments"
    try:
        ledger.store.files.files.close()   # no descriptor of the real files stays open
        shutil.move(seg_dir, tmp_path / "aside")
        seg_dir.mkdir()
        for seg in (tmp_path / "aside").iterdir():
            (seg_dir / seg.name).mkdir()   # a read of it fails with EISDIR: a local error, not proof of loss
        bufs = [bytearray(BLOCK) for _ in keys]
        assert ledger.get_into(keys, bufs) == [-2] * 4
        beat.beat()
        assert members(registry) == [] and beat.fault_reason == "4 block reads failed with a local error"
        assert ledger.exists(keys) == [True] * 4   # still published: another machine may read them
    finally:
        beat.stop()
        ledger.close()
