"""The cluster mode's block ledger on a real JuiceFS volume: two mounts of one volume are two machines.

What assumed a local filesystem, each checked on the real thing: reads list nothing and stat nothing (no
directory mtime), no flock anywhere, opening costs the same at 1 and at 200 segments, a dead mount never
raises out of close, a remounted volume reads again without a restart, and the embedded store (and
`kvledger store`) never writes its LMDB index onto the mount.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections import Counter
from pathlib import Path

import pytest
import redis

from kvledger.store.backend import UNREADABLE
from kvledger.store.ledger import BlockLedger, blocks_dir
from kvledger.store.lmdb_store import LmdbStore, NotEmbeddedFolder

from .conftest import chain

BIG = 1 << 20   # bytes per block where a test needs blocks past the kernel's readahead of an earlier read


def _count_calls(monkeypatch, names: tuple[str, ...], under: Path) -> Counter:
    """Calls of `os.<name>` for each name on a path under `under` or on a descriptor (and of Path.iterdir as
    "iterdir", fcntl.flock/lockf as "flock"). Paths elsewhere are not this store's (redis-py, say, lists
    site-packages for its version when it connects)."""
    calls: Counter = Counter()
    root = str(under)

    def counting(name, fn):  # noqa: ANN001, ANN202
        def wrapped(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            target = a[0] if a else "."
            is_path = isinstance(target, (str, bytes, os.PathLike))
            if not is_path or os.path.abspath(os.fsdecode(target)).startswith(root):
                calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    for name in names:
        monkeypatch.setattr(os, name, counting(name, getattr(os, name)))
    monkeypatch.setattr(Path, "iterdir", counting("iterdir", Path.iterdir))
    monkeypatch.setattr(fcntl, "flock", counting("flock", fcntl.flock))
    monkeypatch.setattr(fcntl, "lockf", counting("flock", fcntl.lockf))
    return calls


LISTINGS = ("listdir", "scandir", "walk")
STATS = ("stat", "lstat", "fstat")


def _ledger(mount, url: str, prefix: str, **kw) -> BlockLedger:
    return BlockLedger.open(path=blocks_dir(mount.path), redis_url=url, fsync=False, prefix=prefix, **kw)


def _big_chain(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    keys, _ = chain(n, seed=seed)
    return keys, [secrets.token_bytes(BIG) for _ in keys]


def test_a_chain_written_on_one_client_reads_on_the_other_listing_and_stating_nothing(tmp_path, juicefs,
                                                                                         redis_server, monkeypatch):
    """Machine B (opened before A wrote) CHECKs and reads A's chain through its own client at once: the index
    names each block's file and offset, so neither the put nor the CHECK nor the read lists the mount or stats
    anything (no directory mtime can matter), and nobody takes an flock."""
    a_mount, b_mount = juicefs.mount(tmp_path / "a"), juicefs.mount(tmp_path / "b")
    b = _ledger(b_mount, redis_server.url, "kvl:")
    a = _ledger(a_mount, redis_server.url, "kvl:")
    keys, blocks = chain(24, seed=3)
    calls = _count_calls(monkeypatch, LISTINGS + STATS, tmp_path)
    assert a.put_chain(keys[:16], blocks[:16]).written == 16
    assert a.put_chain(keys, blocks).written == 8
    assert b.match(keys) == 24
    bufs = [bytearray(len(blocks[0])) for _ in keys]
    assert b.read_prefix(keys, bufs) == 24 and [bytes(x) for x in bufs] == blocks
    assert not calls, f"put, CHECK and read touched the mount's directories or locks: {calls}"
    monkeypatch.undo()
    assert sorted(os.listdir(b_mount.path / "blocks" / "segments")) == sorted(
        os.listdir(a_mount.path / "blocks" / "segments"))   # one volume: two segments, the same on both
    a.close()
    b.close()


def test_opening_costs_the_same_at_1_and_at_200_segments(tmp_path, juicefs, redis_server, monkeypatch):
    """Opening a cluster store (as each engine, fetcher and entrypoint does at start) then its first CHECK and
    read: the same file opens at 200 segments as at 1, and no listing (before, every open read every
    segment's metadata: 12.7 s at 12,000 segments)."""
    a_mount, b_mount = juicefs.mount(tmp_path / "a"), juicefs.mount(tmp_path / "b")
    a = _ledger(a_mount, redis_server.url, "kvl:")
    first_keys, first_blocks = chain(4, seed=0)
    a.put_chain(first_keys, first_blocks)

    def open_check_read() -> Counter:
        calls = _count_calls(monkeypatch, LISTINGS + ("open",), tmp_path)
        b = _ledger(b_mount, redis_server.url, "kvl:")
        assert b.match(first_keys) == 4
        assert b.read_prefix(first_keys, [bytearray(len(first_blocks[0])) for _ in first_keys]) == 4
        b.close()
        monkeypatch.undo()
        return Counter(calls)

    at_1 = open_check_read()
    for seed in range(1, 200):
        keys, blocks = chain(2, seed=seed)
        assert a.put_chain(keys, blocks).written == 2
    assert len(os.listdir(b_mount.path / "blocks" / "segments")) == 200
    at_200 = open_check_read()
    assert at_200 == at_1 and not {k: v for k, v in at_200.items() if k != "open"}, (at_1, at_200)
    assert at_200["open"] <= 3, at_200   # volume.id, the segment read (+ nothing that grows with the store)
    a.close()


def test_close_on_a_dead_mount_never_raises_and_a_read_there_is_a_local_miss(tmp_path, juicefs, redis_server):
    """A client killed under a store that holds open descriptors: close() gave ENOTCONN to the caller before
    (BlockLedger.close raised). A read there is UNREADABLE, and removes no block from the shared index."""
    a_mount, b_mount = juicefs.mount(tmp_path / "a"), juicefs.mount(tmp_path / "b")
    a, b = _ledger(a_mount, redis_server.url, "kvl:"), _ledger(b_mount, redis_server.url, "kvl:")
    keys, blocks = chain(6, seed=5)
    a.put_chain(keys, blocks)
    assert b.read_prefix(keys, [bytearray(len(blocks[0])) for _ in keys]) == 6   # a descriptor cached on b
    b_mount.kill()
    assert b.get_into(keys[:1], [bytearray(len(blocks[0]))]) in ([UNREADABLE], [len(blocks[0])])  # page cache
    assert b.read_fault() is not None
    b.close()   # must not raise
    assert a.match(keys) == 6 and redis.Redis.from_url(redis_server.url).exists(b"kvl:b:" + keys[0])
    a.close()


def test_a_store_reads_again_when_its_volume_is_mounted_again_at_the_same_path(tmp_path, juicefs, redis_server):
    """The client dies and the volume is mounted again at the same path: the running store reads again, no
    restart. Before, a cached descriptor of the dead mount failed every read of its segment forever."""
    a_mount, b_mount = juicefs.mount(tmp_path / "a"), juicefs.mount(tmp_path / "b")
    a, b = _ledger(a_mount, redis_server.url, "kvl:"), _ledger(b_mount, redis_server.url, "kvl:")
    first, first_blocks = _big_chain(4, seed=1)
    second, second_blocks = _big_chain(4, seed=2)
    assert a.put_chain(first, first_blocks).written == 4 and a.put_chain(second, second_blocks).written == 4
    buf = [bytearray(BIG)]
    assert b.get_into(first[:1], buf) == [BIG] and b.get_into(second[:1], buf) == [BIG]   # both files open

    b_mount.kill()   # a read while the mount is dead: a local miss (blocks 2-3 were never in the page cache)
    assert b.get_into(first[2:], [bytearray(BIG) for _ in range(2)]) == [UNREADABLE] * 2
    assert b.read_fault() is not None
    b_mount.unmount()
    b_mount = juicefs.mount(b_mount.path)
    assert b.read_fault() is None
    bufs = [bytearray(BIG) for _ in range(2)]
    assert b.get_into(first[2:], bufs) == [BIG] * 2 and [bytes(x) for x in bufs] == first_blocks[2:]
    # the other file's descriptor (of the dead mount, never failed yet) is opened again on its first read
    assert b.get_into(second[2:], bufs) == [BIG] * 2 and [bytes(x) for x in bufs] == second_blocks[2:]
    assert a.match(first) == a.match(second) == 4   # nothing was unpublished meanwhile
    a.close()
    b.close()


def test_the_embedded_store_refuses_the_mount_and_writes_nothing_there(tmp_path, juicefs, redis_server):
    """LmdbStore refuses a cluster store's folder and any folder on a FUSE filesystem before writing: no
    index.lmdb/, tmp/ or segments/ appears, so no LMDB lock or flock is ever taken on the mount."""
    mount = juicefs.mount(tmp_path / "a")
    cluster = _ledger(mount, redis_server.url, "kvl:")
    keys, blocks = chain(3, seed=9)
    cluster.put_chain(keys, blocks)
    before = sorted(os.listdir(blocks_dir(mount.path)))
    with pytest.raises(NotEmbeddedFolder, match="is a cluster store"):
        LmdbStore(blocks_dir(mount.path))
    with pytest.raises(NotEmbeddedFolder, match="fuse.juicefs"):
        BlockLedger.open(path=mount.path / "plain")
    assert sorted(os.listdir(blocks_dir(mount.path))) == before == ["segments", "volume.id"]
    assert not (mount.path / "plain").exists()
    cluster.close()


@pytest.mark.parametrize("path", ["blocks", "."])
def test_store_stats_without_redis_url_on_the_mount_is_refused_in_one_line(tmp_path, juicefs, redis_server,
                                                                          run_cli, path):
    """`kvledger store stats --path MOUNT/blocks` (or the data dir MOUNT) without --redis-url: before, it opened
    LMDB on the shared mount, wrote index.lmdb/ and tmp/ there, "migrated" every segment and reported 100-year
    expiries. Now: one line, exit 2, saying to give --redis-url, and nothing written. With it: the stats."""
    mount = juicefs.mount(tmp_path / "a")
    cluster = _ledger(mount, redis_server.url, "kvl:")
    keys, blocks = chain(5, seed=4)
    cluster.put_chain(keys, blocks)
    cluster.close()
    store = blocks_dir(mount.path)
    before = sorted(os.listdir(store))
    r = run_cli("store", "stats", "--path", str(mount.path / path), "--json")
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.strip().splitlines()) == 1 and "--redis-url" in r.stderr and "cluster store" in r.stderr
    assert sorted(os.listdir(store)) == before == ["segments", "volume.id"]   # no index.lmdb/, no tmp/
    assert not (mount.path / "index.lmdb").exists() and not (mount.path / "tmp").exists()
    r = run_cli("store", "stats", "--path", str(mount.path / path), "--redis-url", redis_server.url, "--json")
    assert r.returncode == 0, r.stderr
    assert '"blocks":5' in r.stdout and sorted(os.listdir(store)) == before
