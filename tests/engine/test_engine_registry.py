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

    from kvledger.engine.engine_registry import CLOCK_SKEW_S, seal

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
                          KEY, time.time() - 2.0 - CLOCK_SKEW_S - 1, 2.0),
        "aaa-other-token": seal(EngineInfo("aaa-other-token", "prefill", "http://127.0.0.1:9", "tiny-v4", 4096,
                                           100, (0,), 1), derive_keys("u" * 32).registry, time.time(), 2.0),
    }
    for engine_id, raw in forged.items():
        r.sadd(registry.set_key, engine_id)
        r.set(entry + engine_id, raw)   # no expiry, as the attack did
    assert members(registry) == ["prefill-0"]
    assert registry.refused == set(forged)


def test_a_genuine_entry_replayed_after_its_ttl_is_absent(redis_server):
    """Issue 54 item 4: an engine's entry expires from Redis `ttl_s` after its last beat, but main accepted it
    for 30 s: whoever captured a genuine entry could put it back after the engine froze and route requests
    to it (one stalled 3.2 s). Replayed once its TTL and the clock-skew allowance have passed, it is absent."""
    from kvledger.engine.engine_registry import CLOCK_SKEW_S

    ttl_s = 0.5
    registry = Registry.from_url(redis_server.url, KEY, prefix="kvl-replay:", ttl_s=ttl_s)
    registry.announce(info())
    r, entry = registry.redis, registry.entry_prefix + "prefill-0"
    captured = r.get(entry)
    assert members(registry) == ["prefill-0"]
    registry.withdraw("prefill-0")   # the engine froze: no more beats, its entry is gone
    r.sadd(registry.set_key, "prefill-0")
    r.set(entry, captured)           # replayed at once: within its TTL, as a beat would be
    assert members(registry) == ["prefill-0"]
    time.sleep(ttl_s + CLOCK_SKEW_S + 0.2)
    r.sadd(registry.set_key, "prefill-0")
    r.set(entry, captured)           # replayed past its TTL (no expiry, as the attack did)
    assert members(registry) == [] and registry.refused == {"prefill-0"}


def test_an_entry_s_ttl_is_sealed_with_it(redis_server):
    """The age window is the entry's own TTL, so the TTL is under the MAC: a captured entry whose TTL is
    raised to an hour is absent at once."""
    import json as json_

    registry = Registry.from_url(redis_server.url, KEY, prefix="kvl-ttl:")
    registry.announce(info())
    r, entry = registry.redis, registry.entry_prefix + "prefill-0"
    genuine = json_.loads(r.get(entry))
    assert float(genuine["ttl_s"]) == 2.0
    r.set(entry, json_.dumps(genuine | {"ttl_s": "3600.0"}))
    assert members(registry) == [] and registry.refused == {"prefill-0"}


def test_engine_info_refuses_impossible_values():
    base = {"engine_id": "e", "role": "prefill", "url": "http://h:1", "model": "m", "max_model_len": 8,
            "vocab_size": 10, "eos_token_ids": [0], "pid": 1}
    assert EngineInfo.from_dict(base).max_model_len == 8
    for bad in ({"max_model_len": 0}, {"running": -1}, {"eos_token_ids": [10]}, {"url": "file:///etc"},
                {"vocab_size": "10"}, {"role": "oracle"}, {"max_model_len": True}):
        with pytest.raises((ValueError, TypeError, AssertionError)):
            EngineInfo.from_dict(base | bad)
