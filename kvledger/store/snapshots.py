"""Snapshot files follow the block ledger: `kvledger store gc` removes the state ledger's snapshot
files (`<root>/snapshots/<xx>/<key hex>.snap`, util/snapshot_layout.py) whose chain block is gone.

A snapshot is keyed by the chain key of the block that ends at its position, so it belongs to
that block's chain: it lives exactly as long as that block does in the block store — a hit
that refreshes the block keeps its snapshot, and once the block expires by its TTL class (or is
evicted or deleted) the snapshot goes at the next GC. Files younger than `grace_s` are spared (a
snapshot may be written just before its block is published), and so are names that are not a
snapshot's. Stray temporaries of dead writers older than `grace_s` go too.

A forget (store/forget.py) removes the snapshot files of a tenant by the keys of its blocks and tombstones
(`remove_snapshots`): a file records no namespace, its key does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from kvledger.core import KEY_BYTES
from kvledger.store.backend import BlockStore
from kvledger.util.snapshot_layout import key_of, snapshot_path, snapshots_dir

SNAPSHOT_GC_GRACE_S = 60.0
CHUNK = 4096  # keys asked of the block store per call


class SnapshotFile(NamedTuple):
    key: bytes
    path: Path
    size: int
    mtime: float


class SnapshotGc(NamedTuple):
    removed: int
    freed_bytes: int


def snapshot_files(root: str | os.PathLike) -> Iterator[SnapshotFile]:
    """Every snapshot file under `root/snapshots` (none when the folder is missing)."""
    base = snapshots_dir(root)
    if not base.is_dir():
        return
    for folder in base.iterdir():
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            key = key_of(p.name)
            if key is None:
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            yield SnapshotFile(key, p, st.st_size, st.st_mtime)


def remove_snapshots(root: str | os.PathLike, keys: Iterable[bytes]) -> int:
    """Unlink the snapshot files of `keys` under `root` (one unlink each, no listing); how many there were."""
    return sum(_unlink(snapshot_path(root, k)) for k in keys if len(k) == KEY_BYTES)


def snapshot_stats(root: str | os.PathLike) -> tuple[int, int]:
    """(files, bytes) of the snapshot files under `root`."""
    n = size = 0
    for f in snapshot_files(root):
        n += 1
        size += f.size
    return n, size


def collect_snapshots(root: str | os.PathLike, store: BlockStore, *, grace_s: float = SNAPSHOT_GC_GRACE_S,
                      now: float | None = None) -> SnapshotGc:
    """Remove the snapshot files whose chain block `store` no longer holds (see the module docstring)."""
    cutoff = (time.time() if now is None else now) - grace_s
    old = [f for f in snapshot_files(root) if f.mtime < cutoff]
    removed = freed = 0
    for i in range(0, len(old), CHUNK):
        chunk = old[i:i + CHUNK]
        failures = store.counters.exists_failures
        answer = store.exists([f.key for f in chunk])
        if store.counters.exists_failures != failures:  # an unreachable index says nothing is alive: stop
            break
        for f, alive in zip(chunk, answer):
            if not alive and _unlink(f.path):
                removed += 1
                freed += f.size
    _remove_stray_temporaries(Path(root) / "snapshots", cutoff)
    return SnapshotGc(removed, freed)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _remove_stray_temporaries(base: Path, cutoff: float) -> None:
    """`.<name>.<pid>.<rand>.tmp` files (state/files.py) of writes that never finished."""
    if not base.is_dir():
        return
    for p in base.glob("*/.*.tmp"):
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
        except OSError:
            continue
