"""Where a snapshot file lies: the one definition of the layout the state ledger writes (state/files.py) and the
store's collector and forget read (store/snapshots.py).

    <root>/snapshots/<first 2 hex digits>/<chain key in hex>.snap

A snapshot is named by the chain key of the block that ends at its position (DESIGN rule 4).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvledger.core import KEY_BYTES

FOLDER = "snapshots"
SUFFIX = ".snap"


def snapshots_dir(root: str | os.PathLike) -> Path:
    return Path(root) / FOLDER


def snapshot_path(root: str | os.PathLike, key: bytes) -> Path:
    """The file of the snapshot under chain key `key` in the store at `root`."""
    assert len(key) == KEY_BYTES
    h = key.hex()
    return snapshots_dir(root) / h[:2] / f"{h}{SUFFIX}"


def key_of(name: str) -> bytes | None:
    """The chain key a file name in the layout names; None for any other name (a temporary, a stray file)."""
    if not name.endswith(SUFFIX) or len(name) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None
