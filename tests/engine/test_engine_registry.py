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

import pytest

from kvledger.engine.engine_registry import EngineInfo, Heartbeat, Registry
from kvledger.state.auth import derive_keys
from kvledger.store.ledger import BlockLedger
from kvledger.store.redis_backend import VOLUME_FILE

from ..store.conftest import BLOCK, chain


KEY = derive_keys("t" * 32).registry


def info() -> EngineInfo:
    return EngineInfo("prefill-0", "prefill", "http://127.0.0.1:1", "tiny-v4", 4096, 100, (0,), os.getpid())


def members(registry: Registry) -> list[str]:
    return [e.engine_id for e in registry.members()]


def test_an_engine_whose_store_does_not_read_leaves_the_registry_and_comes_back(tmp_path, redis_server):
    ledger = BlockLedger.open(path=tmp_path / "blocks", redis_url=redis_server.url)
    registry = Registry.from_url(redis_server.url, KEY, prefix="kvl-hb1:")
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
    registry = Registry.from_url(redis_server.url, KEY, prefix="kvl-hb2:")
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


# --- entries are MACed under the cluster token (issue 20 item 1) -------------------------------------------


def test_an_entry_not_sealed_by_a_cluster_engine_is_absent(redis_server):
    """What a Redis writer can do without the token: a plain entry (the old format), a genuine one with a
    field changed (its URL, its limits), a genuine one under another id, an old one replayed. None lists."""
    import json as json_

    from kvledger.engine.engine_registry import MAX_AGE_S, seal

    registry = Registry.from_url(redis_server.url, KEY, prefix="kvl-forge:")
    registry.announce(info())
    r, entry = registry.redis, registry.entry_prefix
    genuine = json_.loads(r.get(entry + "prefill-0"))
    body = json_.loads(genuine["info"])
    forged = {
        "aaa-plain": json_.dumps(body | {"engine_id": "aaa-plain", "url": "http://127.0.0.1:9"}),
        "aaa-url": json_.dumps(genuine | {"info": json_.dumps(body | {"url": "http://127.0.0.1:9"})}),
        "aaa-limits": json_.dumps(genuine | {"info": json_.dumps(body | {"max_model_len": 2})}),
        "aaa-renamed": json_.dumps(genuine),
        "aaa-stale": seal(EngineInfo("aaa-stale", "prefill", "http://127.0.0.1:9", "tiny-v4", 4096, 100, (0,), 1),
                          KEY, time.time() - MAX_AGE_S - 1),
        "aaa-other-token": seal(EngineInfo("aaa-other-token", "prefill", "http://127.0.0.1:9", "tiny-v4", 4096,
                                           100, (0,), 1), derive_keys("u" * 32).registry, time.time()),
    }
    for engine_id, raw in forged.items():
        r.sadd(registry.set_key, engine_id)
        r.set(entry + engine_id, raw)   # no expiry, as the attack did
    assert members(registry) == ["prefill-0"]
    assert registry.refused == set(forged)


def test_engine_info_refuses_impossible_values():
    base = {"engine_id": "e", "role": "prefill", "url": "http://h:1", "model": "m", "max_model_len": 8,
            "vocab_size": 10, "eos_token_ids": [0], "pid": 1}
    assert EngineInfo.from_dict(base).max_model_len == 8
    for bad in ({"max_model_len": 0}, {"running": -1}, {"eos_token_ids": [10]}, {"url": "file:///etc"},
                {"vocab_size": "10"}, {"role": "oracle"}, {"max_model_len": True}):
        with pytest.raises((ValueError, TypeError, AssertionError)):
            EngineInfo.from_dict(base | bad)
