"""Cluster mode: Redis answers CHECK for everyone, the bytes live in segment files on a shared mount.

Two ledgers with their own FileStore over one directory stand for two machines."""

from __future__ import annotations

import pytest
import redis

from kvledger.store import redis_backend
from kvledger.store.file_backend import FileStore
from kvledger.store.ledger import BlockLedger
from kvledger.store.redis_backend import RedisStore

from .conftest import BLOCK, chain


def test_two_machines_share_index_and_files(tmp_path, redis_server):
    a = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    b = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(12)
    assert a.put_chain(keys[:8], blocks[:8]) == (8, 0, 0)
    assert b.match(keys) == 8  # the other machine's CHECK sees it at once (Redis)
    assert b.put_chain(keys, blocks) == (4, 8, 0)  # and writes only what is missing
    bufs = [bytearray(BLOCK) for _ in keys]
    assert a.get_into(keys, bufs) == [BLOCK] * 12 and [bytes(x) for x in bufs] == blocks
    r = redis.Redis.from_url(redis_server.url)
    assert r.dbsize() == 12 + 1 and r.hget(b"kvl:b:" + keys[0], "d") is None  # metadata only (+ the volume id)
    assert r.get(b"kvl:volume").decode() == (tmp_path / "volume.id").read_text().strip()
    st = a.stats()
    assert st.blocks == 12 and st.segments == 2 and st.disk_bytes > 12 * BLOCK


def test_gc_removes_file_blocks_redis_forgot_tails_first(tmp_path, redis_server, monkeypatch):
    led = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(10)
    led.put_chain(keys, blocks)
    r = redis.Redis.from_url(redis_server.url)
    r.delete(*[b"kvl:b:" + k for k in keys[6:]])  # as if they had expired
    monkeypatch.setattr(redis_backend, "GC_GRACE_S", -1.0)
    res = led.gc()
    assert res.expired == 4 and res.freed_bytes == 4 * BLOCK
    files: FileStore = led.store.files
    assert sorted(b.pos for b in files.blocks()) == list(range(6))
    assert led.match(keys) == 6


def test_lost_bytes_are_unpublished_and_rewritten(tmp_path, redis_server):
    led = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(4)
    led.put_chain(keys, blocks)
    seg = next((tmp_path / "segments").iterdir())
    seg.unlink()  # the shared filesystem lost them
    other = BlockLedger(RedisStore(redis_server.url, files=FileStore(tmp_path, fsync=False)))
    assert other.match(keys) == 4
    assert other.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [-1] * 4
    assert other.match(keys) == 0  # unpublished: the next CHECK misses, the next put writes again
    assert other.put_chain(keys, blocks) == (4, 0, 0) and other.read_prefix(keys, [bytearray(BLOCK) for _ in keys]) == 4


def test_redis_down_in_cluster_mode_fails_soft(tmp_path, redis_server):
    led = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False, timeout_s=0.5)
    keys, blocks = chain(3)
    redis_server.kill()
    assert led.match(keys) == 0
    res = led.put_chain(keys, blocks)
    assert res.written == 0 and res.failed == 3  # bytes may land on files, but nothing is published
    assert led.gc().expired == 0 and led.stats().blocks == 0


def test_a_local_read_error_never_unpublishes_a_shared_block(tmp_path, redis_server):
    """Rule 8: a read that fails with an error on this machine (EIO, ENOTCONN, ESTALE; here EISDIR, the segment
    replaced by a folder after B listed it) is UNREADABLE: a miss here, and the block stays published for the
    machines that can read it. (Before, B's failed read deleted A's whole chain from the shared index.)"""
    import shutil

    from kvledger.store.backend import UNREADABLE

    a = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(6)
    a.put_chain(keys, blocks)
    b = RedisStore(redis_server.url, files=FileStore(tmp_path, fsync=False))
    assert b.exists(keys) == [True] * 6
    seg = next((tmp_path / "segments").iterdir())
    saved = tmp_path / "saved.kvs"
    shutil.move(seg, saved)
    seg.mkdir()   # a read of it now fails with an error, not with a short read
    assert b.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [UNREADABLE] * 6
    assert b.files.counters.misses_unreadable == 6 and b.files.counters.misses_truncated == 0
    assert a.match(keys) == 6, "a local read error unpublished the shared chain"
    seg.rmdir()
    shutil.move(saved, seg)   # the mount is back: the blocks were never lost
    assert a.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * 6


def test_a_folder_that_is_not_the_shared_volume_is_refused(tmp_path, redis_server):
    """The volume identity: an empty mount point (the shared filesystem not mounted) must not open as a private
    store whose reads would unpublish everyone's blocks and whose puts nobody else could read."""
    shared, empty = tmp_path / "mnt", tmp_path / "not-mounted"
    a = BlockLedger.open(path=shared, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(6)
    a.put_chain(keys, blocks)
    empty.mkdir()
    with pytest.raises(ValueError, match="is not the volume"):
        BlockLedger.open(path=empty, redis_url=redis_server.url, fsync=False)
    assert a.match(keys) == 6
    again = BlockLedger.open(path=shared, redis_url=redis_server.url, fsync=False)   # the right folder opens
    assert again.read_prefix(keys, [bytearray(BLOCK) for _ in keys]) == 6
