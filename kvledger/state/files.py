"""Persisted snapshots for the `full` and `periodic:N` strategies: one checksummed file per snapshot.

Layout: `<root>/snapshots/<first byte of key, hex>/<key hex>.snap`; a file is a 32-byte header
(magic "KVLSNAP1", position u64, size u64, xxh3-64 of the payload u64, little-endian) then
the payload. A write goes to a temporary file in the same folder and is renamed over the
final name (atomic on POSIX), so a reader sees a whole snapshot or none. A file that is
short, has a bad header or a checksum mismatch is a miss and is removed. No pickle.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import uuid
from pathlib import Path

from kvledger.state.pool import checksum
from kvledger.util.private_file import open_private, private_dir
from kvledger.util.snapshot_layout import snapshot_path, snapshots_dir

MAGIC = b"KVLSNAP1"
_HEADER = struct.Struct("<8sQQQ")
HEADER_BYTES = _HEADER.size


class SnapshotFiles:
    """Snapshot files under `root/snapshots`. `durable=True` fsyncs each file and its folder."""

    def __init__(self, root: str | Path, *, max_bytes: int = 64 << 20, durable: bool = False) -> None:
        self.root = Path(root)
        self.dir = snapshots_dir(root)
        private_dir(self.dir)   # 0700, its files 0600: whatever the writer's umask (DESIGN)
        self.max_bytes = max_bytes
        self.durable = durable
        self.corrupt = 0  # files found damaged and removed

    def path(self, key: bytes) -> Path:
        return snapshot_path(self.root, key)

    def write(self, key: bytes, position: int, data: bytes | bytearray | memoryview) -> None:
        data = memoryview(data).cast("B")
        assert 0 <= data.nbytes <= self.max_bytes and position >= 0
        final = self.path(key)
        private_dir(final.parent)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_EXCL), "wb") as f:
                f.write(_HEADER.pack(MAGIC, position, data.nbytes, checksum(data)))
                f.write(data)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        if self.durable:
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def exists(self, key: bytes) -> bool:
        """Whether the snapshot's file is there; a mount that fails the stat (EIO, ESTALE, ENOTCONN) answers no
        (rule 8: a fault is a miss, never a failed request)."""
        try:
            return self.path(key).is_file()
        except OSError:
            return False

    def read(self, key: bytes) -> tuple[int, bytearray] | None:
        """(position, bytes), or None when absent or damaged (a damaged file is removed)."""
        p = self.path(key)
        try:
            with open(p, "rb", buffering=0) as f:
                head = f.read(HEADER_BYTES)
                if len(head) != HEADER_BYTES:
                    return self._damaged(p)
                magic, position, size, digest = _HEADER.unpack(head)
                if magic != MAGIC or size > self.max_bytes:
                    return self._damaged(p)
                buf = bytearray(size)
                if f.readinto(buf) != size or f.read(1):
                    return self._damaged(p)
        except FileNotFoundError:
            return None
        except OSError:
            return None
        if checksum(buf) != digest:
            return self._damaged(p)
        return position, buf

    def remove(self, key: bytes) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def gc(self, max_age_s: float, now: float | None = None) -> int:
        """Remove snapshot files (and stray temporaries) last written more than `max_age_s` ago;
        how many were removed. A reader racing it sees a whole file or a miss."""
        cutoff = (time.time() if now is None else now) - max_age_s
        removed = 0
        for p in self.dir.glob("*/*"):
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _damaged(self, p: Path) -> None:
        self.corrupt += 1
        with contextlib.suppress(OSError):
            p.unlink()
        return None
