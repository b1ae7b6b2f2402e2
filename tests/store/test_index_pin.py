"""IndexPin keeps a file's pages in the page cache against reclaim: asked with posix_fadvise(DONTNEED), which drops
a clean file's unmapped, unlocked pages at once, and measured with mincore (cached_share)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvledger.store.index_pin import IndexPin, cached_share
from kvledger.store.lmdb_store import LmdbStore

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlock, mincore and fadvise: Linux")

MIB = 1 << 20


def written(path: Path, n: int, mode: str = "wb") -> Path:
    with open(path, mode) as f:
        f.write(os.urandom(n))
        f.flush()
        os.fsync(f.fileno())   # clean pages: DONTNEED can drop them
    return path


def drop_cache(path: Path) -> float | None:
    """Ask the kernel to drop the file's cached pages; the share still cached after."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_share(path)


def locked_kib() -> int:
    """Locked memory of this process (VmLck), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def test_a_pinned_file_survives_a_drop_of_its_cache_and_a_closed_pin_lets_it_go(tmp_path):
    path = written(tmp_path / "data.mdb", 4 * MIB)
    assert drop_cache(path) == 0.0          # the check can fail: an unpinned file's pages go
    before = locked_kib()
    with IndexPin(str(path)) as pin:
        assert pin.start().wait(30)
        assert pin.mode == "locked" and pin.pinned_bytes == pin.locked_bytes == 4 * MIB
        assert locked_kib() - before == 4 * 1024
        assert cached_share(path) == 1.0    # pinning read the file back in
        assert drop_cache(path) == 1.0
    assert pin.mode == "off" and pin.pinned_bytes == 0 and locked_kib() == before
    assert drop_cache(path) == 0.0


def test_the_pin_follows_the_file_as_it_grows(tmp_path):
    path = written(tmp_path / "data.mdb", 2 * MIB)
    with IndexPin(str(path), every_s=3600) as pin:
        assert pin.start().wait(30) and pin.pinned_bytes == 2 * MIB
        written(path, 3 * MIB, "ab")
        assert drop_cache(path) == 2 / 5     # the new tail is not pinned yet
        assert pin.extend() == 3 * MIB and pin.extend() == 0
        assert drop_cache(path) == 1.0 and pin.pinned_bytes == 5 * MIB


def test_unlocked_the_pin_keeps_the_pages_mapped_which_a_drop_of_the_cache_spares(tmp_path):
    path = written(tmp_path / "data.mdb", 2 * MIB)
    drop_cache(path)
    before = locked_kib()
    with IndexPin(str(path), lock=False) as pin:
        assert pin.start().wait(30) and pin.mode == "mapped"
        assert locked_kib() == before
        assert drop_cache(path) == 1.0
    assert drop_cache(path) == 0.0


def test_past_its_lock_budget_the_pin_maps_instead_of_locking(tmp_path):
    path = written(tmp_path / "data.mdb", 4 * MIB)
    drop_cache(path)
    before = locked_kib()
    with IndexPin(str(path), lock_budget=MIB) as pin:   # a node whose memory is short for its index
        assert pin.start().wait(30) and pin.mode == "mapped"
        assert pin.locked_bytes == 0 and pin.pinned_bytes == 4 * MIB and locked_kib() == before
        assert drop_cache(path) == 1.0


def test_a_store_opened_to_pin_its_index_pins_it_and_unpins_at_close(tmp_path):
    with LmdbStore(tmp_path / "store", fsync=False, pin_index=True) as store:
        assert store.pin is not None and store.pin.wait(30) and store.pin.mode == "locked"
        assert store.pin.pinned_bytes == os.path.getsize(tmp_path / "store" / "index.lmdb" / "data.mdb") > 0
    assert store.pin.mode == "off"
    with LmdbStore(tmp_path / "store", fsync=False) as store:
        assert store.pin is None   # the default: only a node's serving process pins
