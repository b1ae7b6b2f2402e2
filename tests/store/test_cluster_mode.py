"""Cluster mode: Redis answers CHECK for everyone, the bytes live in segment files on a shared mount.

Two ledgers with their own SharedFiles over one directory stand for two machines."""

from __future__ import annotations

import os
import secrets
from collections import Counter
from pathlib import Path

import pytest
import redis
import redis.connection

from kvledger.store import redis_backend
from kvledger.store.ledger import BlockLedger
from kvledger.store.redis_backend import RedisStore
from kvledger.store.shared_files import SharedFiles

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
    assert r.dbsize() == 12 + 12 + 1 + 2 and r.hget(b"kvl:b:" + keys[0], "d") is None  # metadata only (+ the
    # blocks' tombstones, the volume id, and their bucket's totals and set: redis_quota.py)
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
    files: SharedFiles = led.store.files
    assert sorted(b.pos for b in files.blocks()) == list(range(6))
    assert led.match(keys) == 6


def test_lost_bytes_are_unpublished_and_rewritten(tmp_path, redis_server):
    led = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    keys, blocks = chain(4)
    led.put_chain(keys, blocks)
    seg = next((tmp_path / "segments").iterdir())
    seg.unlink()  # the shared filesystem lost them
    other = BlockLedger(RedisStore(redis_server.url, files=SharedFiles(tmp_path, fsync=False)))
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
    b = RedisStore(redis_server.url, files=SharedFiles(tmp_path, fsync=False))
    assert b.exists(keys) == [True] * 6
    seg = next((tmp_path / "segments").iterdir())
    saved = tmp_path / "saved.kvs"
    shutil.move(seg, saved)
    seg.mkdir()   # a read of it now fails with an error, not with a short read
    assert b.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [UNREADABLE] * 6
    assert b.counters.misses_unreadable == 6 and b.counters.misses_truncated == 0
    assert a.match(keys) == 6, "a local read error unpublished the shared chain"
    seg.rmdir()
    shutil.move(saved, seg)   # the mount is back: the blocks were never lost
    assert a.get_into(keys, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * 6


def test_a_machine_opening_while_another_writes_the_volume_id_agrees_on_it(tmp_path, redis_server, monkeypatch):
    """Two machines open a fresh volume at once: the second looks while the first is still writing its id
    (here: as the first one draws the id it is about to write). Both must end on one id, which Redis then
    records; before, the second read the first one's file empty, put "" in Redis, and the first was refused."""
    from kvledger.store import shared_files

    opened: list[BlockLedger] = []
    real_token_hex = secrets.token_hex

    def token_hex_while_the_other_machine_opens(nbytes: int) -> str:
        if nbytes == 16 and not opened:
            opened.append(None)   # once: the other machine's own open draws its id undisturbed
            opened[0] = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
        return real_token_hex(nbytes)

    monkeypatch.setattr(shared_files.secrets, "token_hex", token_hex_while_the_other_machine_opens)
    first = BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False)
    volume = (tmp_path / "volume.id").read_text().strip()
    assert len(volume) == 32 and redis.Redis.from_url(redis_server.url).get(b"kvl:volume").decode() == volume
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".volume")) == []   # no id file left
    keys, blocks = chain(3)
    first.put_chain(keys, blocks)
    assert opened[0].read_prefix(keys, [bytearray(BLOCK) for _ in keys]) == 3


def test_an_empty_volume_id_left_in_redis_by_that_race_is_replaced(tmp_path, redis_server):
    """A Redis that recorded "" (the race above, before it was fixed) would refuse every machine for good; the
    first store to open now records its folder's id, and a folder of another volume is still refused."""
    r = redis.Redis.from_url(redis_server.url)
    r.set(b"kvl:volume", b"")
    a = BlockLedger.open(path=tmp_path / "mnt", redis_url=redis_server.url, fsync=False)
    assert r.get(b"kvl:volume").decode() == (tmp_path / "mnt" / "volume.id").read_text().strip()
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="is not the volume"):
        BlockLedger.open(path=tmp_path / "other", redis_url=redis_server.url, fsync=False)
    a.close()


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


def _count_round_trips(monkeypatch) -> Counter:
    """Every batch written to a Redis socket, by port: one per round trip (whatever sends it: a pipeline,
    a script call, a plain command)."""
    sends: Counter = Counter()
    original = redis.connection.Connection.send_packed_command

    def counted(self, command, check_health=True):  # noqa: ANN001, ANN202
        sends[self.port] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)
    return sends


def _count_listings_and_preads(monkeypatch) -> Counter:
    """Calls that list a folder (os.listdir, os.scandir, os.walk, Path.iterdir) and preadv calls."""
    calls: Counter = Counter()

    def counting(name, fn):  # noqa: ANN001, ANN202
        def wrapped(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    for name in ("listdir", "scandir", "walk", "preadv"):
        monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
    monkeypatch.setattr(Path, "iterdir", counting("iterdir", Path.iterdir))
    return calls


@pytest.mark.parametrize("where", ["redis_server", "redis_cluster"])
def test_a_cluster_check_and_read_cost_one_round_trip_and_no_listing(tmp_path, where, request, monkeypatch):
    """The location of a block's bytes is in its Redis record: machine B, opened before A wrote, CHECKs in one
    round trip per master touched and reads a chain in one more (the metadata of all its keys) plus one preadv
    per segment, listing nothing. (Before, the read was an EXISTS round trip and then B's own index of the
    files, which did not know A's segment: a listing of the mount on the read path.)"""
    url = request.getfixturevalue(where).url
    prefix = f"t{secrets.token_hex(4)}:"
    b = BlockLedger.open(path=tmp_path, redis_url=url, fsync=False, prefix=prefix)
    a = BlockLedger.open(path=tmp_path, redis_url=url, fsync=False, prefix=prefix)
    keys, blocks = chain(96, seed=7)
    assert a.put_chain(keys[:64], blocks[:64]).written == 64
    assert a.put_chain(keys, blocks).written == 32   # two segments: 64 + 32 blocks
    assert b.match(keys) == 96                       # scripts loaded on every master, slot map learned
    nodes = b.store.nodes
    touched = {nodes.node_of(b.store.place.slot(k)).connection_pool.connection_kwargs["port"] for k in keys}
    assert where == "redis_server" or len(touched) == 3

    trips, calls = _count_round_trips(monkeypatch), _count_listings_and_preads(monkeypatch)
    assert b.match(keys) == 96
    assert set(trips) == touched and all(v == 1 for v in trips.values()), f"CHECK: {trips}"
    trips.clear()
    bufs = [bytearray(BLOCK) for _ in keys]
    assert b.get_into(keys, bufs) == [BLOCK] * 96 and [bytes(x) for x in bufs] == blocks
    assert set(trips) == touched and all(v == 1 for v in trips.values()), f"read: {trips}"
    assert calls["preadv"] == 2, calls           # one per run of blocks back to back in one file
    assert not {k: v for k, v in calls.items() if k != "preadv"}, f"the read path listed a folder: {calls}"
    b.close()
    a.close()


def test_a_cluster_store_folder_is_refused_by_the_embedded_store_and_by_store_stats(tmp_path, redis_server, run_cli):
    """A folder holding `volume.id` is a cluster store (its index on Redis): LmdbStore refuses it before writing
    (before, it wrote index.lmdb/ and tmp/ there and indexed every segment as its own), and `kvledger store`
    without --redis-url answers one line, exit 2. (The same on a real JuiceFS mount: test_juicefs.py.)"""
    from kvledger.store.lmdb_store import LmdbStore, NotEmbeddedFolder

    with BlockLedger.open(path=tmp_path, redis_url=redis_server.url, fsync=False) as a:
        keys, blocks = chain(4)
        a.put_chain(keys, blocks)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(NotEmbeddedFolder, match="cluster store"):
        LmdbStore(tmp_path)
    with pytest.raises(NotEmbeddedFolder):
        BlockLedger.open(path=tmp_path)
    for cmd in ("stats", "gc", "verify"):
        r = run_cli("store", cmd, "--path", str(tmp_path), "--json")
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (cmd, r)
        assert "give --redis-url" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before == ["segments", "volume.id"]
