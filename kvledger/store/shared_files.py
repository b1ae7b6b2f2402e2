"""The bytes of the cluster mode: segment files on a shared mount (3FS, CephFS, NFS), read by location.

The index (Redis) records where each block's bytes are, a `segment_files.Location`: the segment file's
name and the block's byte offset in it (size and xxh3-64 are in the block's metadata). So this side keeps no index
and a read never lists the mount:

    write:  the blocks of one put → one segment (SegmentFiles.write: tmp, writev, fsync, rename) → a
            Location per block, published by the caller only once the file is whole
    read:   blocks back to back in one file → one preadv into the caller's buffers, each checked
    gc:     upkeep, listing the mount: a segment older than the grace whose blocks the index no longer
            knows is unlinked; a dead tail of a segment is cut off (segment.py: an entry whose bytes lie
            past the end of the file is gone)

Read outcomes (DESIGN.md rule 8): the block's size; "corrupt" (checksum mismatch) or "truncated" (a short
read of a present file, or the file absent from a folder that is still the volume) are proven damage;
"unreadable" is a local error (EIO, ENOTCONN, ESTALE, an absent file on a folder that is not the volume
any more): this machine's problem, which removes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


from kvledger.store import segment as sg
from kvledger.store.backend import BlockInfo, ChainWrite, Dest, probe_folder
from kvledger.store.forget import owned_by
from kvledger.store.segment_files import STALE_TMP_S, Location, Outcome, PartDone, SegmentFiles
from kvledger.util.private_file import open_private

log = logging.getLogger("kvledger.store")

VOLUME_FILE = "volume.id"   # in the shared store folder: the id of the volume, as the index records it
__all__ = ["Location", "Outcome", "SharedFiles", "VOLUME_FILE"]


class SharedFiles:
    """The segment files under `root/segments` and the volume id `root/volume.id` (see the module docstring).
    Every method but `write` and `claim_volume` absorbs storage faults; those two raise `OSError`."""

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True, create: bool = True) -> None:
        self.root = Path(root)
        if not create and not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such directory")
        self.files = SegmentFiles(self.root, fsync=fsync)
        self.volume_id = ""   # `claim_volume`: what `root/volume.id` said at open

    # --- write and read ---------------------------------------------------------------

    def write(self, write: ChainWrite, sel: Sequence[int], views: Sequence[memoryview], now: float) -> list[Location]:
        """One segment holding the blocks `sel` of `write` (in chain order), whole and renamed in; their
        locations."""
        name, rows = self.files.write(write, sel, views, now)
        return [Location(name, off, size, xxh) for _, _, _, size, xxh, off in rows]

    def read(self, located: Sequence[tuple[int, Location]], bufs: Sequence[Dest],
             on_part: PartDone | None = None) -> list[Outcome]:
        """Read each (i, location) into `bufs[i]`; one outcome per item, in order (`SegmentFiles.read_blocks`):
        a file absent from the folder is "truncated" (proven loss) while the folder is still the volume, and
        "unreadable" when it is not (the volume is not mounted here any more)."""
        out = self.files.read_blocks(located, bufs, on_part)
        if "missing" in out:
            gone = "truncated" if self.is_volume() else "unreadable"
            out = [gone if o == "missing" else o for o in out]
        return out

    # --- the volume ------------------------------------------------------------------

    def claim_volume(self) -> str:
        """The volume id of this folder (`VOLUME_FILE`), created when the folder holds none. The id is written
        whole to a file of this opener's own and then hard-linked in, so concurrent first opens (other
        machines' mounts included) agree on one id and none reads a half-written file. An empty mount point
        gets a new id, which the index then refuses. ValueError when the file is there but holds no id."""
        path = self.root / VOLUME_FILE
        if not path.exists():   # (a folder that went read-only still opens while its id is there)
            mine = self.root / f".{VOLUME_FILE}.{secrets.token_hex(8)}.tmp"
            try:
                with os.fdopen(open_private(mine, os.O_WRONLY | os.O_EXCL), "w") as f:   # 0600 (DESIGN)
                    f.write(secrets.token_hex(16) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                with contextlib.suppress(FileExistsError):   # another opener's id is in place: it stands
                    os.link(mine, path)   # atomic: the whole file appears, or nothing does
            finally:
                mine.unlink(missing_ok=True)
        self.volume_id = path.read_text().strip()
        if not self.volume_id:
            raise ValueError(f"{path} holds no volume id: remove it only if no index describes this volume")
        return self.volume_id

    def probe(self) -> str | None:
        """None while this machine reads the folder and it is still the volume it was at open (an unmounted
        path shows the empty mount point, which holds no `VOLUME_FILE` or another one); else why not."""
        if (why := probe_folder(self.files.seg_dir)) is not None:
            return why
        try:
            volume = (self.root / VOLUME_FILE).read_text().strip()
        except OSError as e:
            return f"{self.root / VOLUME_FILE} does not read ({e.strerror})"
        if volume != self.volume_id:
            return f"{self.root} is no longer the volume opened ({VOLUME_FILE} says {volume or 'nothing'})"
        return None

    def is_volume(self) -> bool:
        return bool(self.volume_id) and self.probe() is None

    # --- upkeep (these list the mount) ----------------------------------------------------

    def segments(self) -> Iterator[tuple[str, sg.SegmentMeta, int]]:
        """(name, metadata, file size) of every readable segment; one that fails its metadata is skipped."""
        for name in sorted(self.files.names()):
            try:
                got = self.files.read_meta(name)
            except (OSError, sg.BadSegment) as e:
                log.info("segment %s skipped: %s", name, e)
                continue
            if got is not None:
                yield name, *got

    def blocks(self) -> Iterator[BlockInfo]:
        """Every block whose bytes are in a file (the index may have forgotten it; expiry None)."""
        for _, meta, size in self.segments():
            for key, parent, pos, bsize, _, off in meta.entries:
                if off + bsize <= size:
                    yield BlockInfo(key, parent, pos, bsize, meta.created, None, meta.namespace, meta.ttl_class)

    def usage(self) -> tuple[int, int]:
        """(segment files, their bytes)."""
        n = nbytes = 0
        for name in self.files.names():
            try:
                nbytes += os.stat(self.files.seg_dir / name).st_size
                n += 1
            except OSError:
                continue
        return n, nbytes

    def collect(self, known: Callable[[list[bytes]], list[bool]], grace_s: float, batch: int) -> tuple[int, int, int]:
        """Remove the blocks of segments older than `grace_s` whose keys `known` (the index) no longer holds:
        a segment none of whose blocks is known is unlinked, a dead tail is cut off (tails first: a chain's
        blocks lie in chain order); (blocks removed, bytes freed, batches). `known` raises on a fault (a
        fault must not read as "forgotten"); so does this. Temporary files of dead writers go too."""
        self.files.remove_stale_tmp(STALE_TMP_S)
        cutoff = time.time() - grace_s
        removed = freed = batches = 0
        for name, meta, size in list(self.segments()):
            entries = [e for e in meta.entries if e[5] + e[3] <= size]
            if meta.created >= cutoff or not entries:
                continue
            alive: list[bool] = []
            for i in range(0, len(entries), batch):
                alive += known([e[0] for e in entries[i:i + batch]])
                batches += 1
            end = max((e[5] + e[3] for e, a in zip(entries, alive) if a), default=0)
            dead = sum(1 for e in entries if e[5] >= end)
            if not dead:
                continue
            if end == 0:
                self.files.unlink(name)
            else:
                self.files.cut(name, end)
            removed, freed = removed + dead, freed + size - (end or 0)
        return removed, freed, batches

    def forget(self, tenant: str) -> int:
        """Unlink every segment whose header names one of `tenant`'s namespaces (a forget, store/forget.py: the
        index's records of its blocks are gone first); how many. Lists the mount."""
        n = 0
        for name, meta, _ in list(self.segments()):
            if owned_by(meta.namespace, tenant):
                self.files.unlink(name)
                n += 1
        return n

    def close(self) -> None:
        self.files.close()
