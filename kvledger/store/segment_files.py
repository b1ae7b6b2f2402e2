"""A flat segment directory (`root/segments/*.kvs`, format in segment.py): file names, whole-segment
writes, reads through a cache of open descriptors; and the I/O helpers every store's files share.

No index here: this module moves bytes between the caller and the files (the cluster mode's
SharedFiles; the previous layout of the embedded store, which the LMDB store migrates). Every
method raises `OSError` on a fault; the store decides what a fault means (a miss, a failed put).

    write:  .tmp-<host>-<pid>-<rand>  --pwritev, fsync-->  rename to <ns time>-<host>-<pid>-<rand>.kvs
            (`write_segment`: the blocks a piece at a time, then the metadata that holds their hashes)
    read:   blocks by `Location` (file, offset, size, xxh3-64), as an index records them: a run of blocks back to
            back in one file is read straight into the caller's buffers a piece at a time (one preadv per
            READ_PIECE_BYTES), each block checked once its piece is in; a cached descriptor whose read fails is
            dropped and the file opened again (a shared mount mounted again at the same path after its client
            died reads again, without a restart)

Why pieces: the xxh3-64 of every block costs about half as much CPU as the copy between the page cache and the
caller (measured: docs/store.md, "Store I/O against plain I/O"). A hash holds the GIL; a preadv or pwritev does
not. So a helper thread moves piece k + 1 (read) or k - 1 (write) while the calling thread hashes piece k: with a
second core free the hashing costs no wall time, and a read piece small enough for one core's L2 is hashed from the
cache its copy just filled. A run of one piece never leaves the calling thread.

Read outcomes: the size read; "corrupt" (checksum mismatch), "truncated" (a short read), "missing" (no such
file), "unreadable" (any other OSError: EIO, ENOTCONN, ESTALE...). What each means is the store's to say
(DESIGN.md rule 8: on a shared mount only proven damage removes a block).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from kvledger.store import segment as sg
from kvledger.store.backend import ChainWrite
from kvledger.util.private_file import open_private, private_dir

IOV_MAX = 1024
READ_PIECE_BYTES = 512 << 10    # a run of blocks is read this much at a time: about one core's L2, so a piece is
#                                 hashed while the copy just left it in cache (512 KiB: 15.0-15.5 ms per 29 MB
#                                 cold read, 2 MiB: 18.9-19.0, one piece: 19.1; plain preadv 13.5-15.1)
WRITE_PIECE_BYTES = 2 << 20     # and a segment written this much at a time (2 MiB: 40.3 ms per 29 MB put with
#                                 fsync, 512 KiB: 42.8, one piece: 49.4)
HELPER_THREADS = 8      # at most this many pieces in flight in one process (one per reading or writing thread)
_helpers: tuple[int, ThreadPoolExecutor] | None = None   # (pid, executor): see `background`
_helpers_lock = threading.Lock()
MAX_OPEN_FDS = 128
STALE_TMP_S = 3600.0  # verify removes temporary files of any host older than this
HOST = socket.gethostname().replace("-", "_")
OFFSET = struct.Struct("<Q")
PartDone = Callable[[int], None]   # `read_by_part`'s progress: parts [0, k) of every block being read are in
Outcome = int | str   # a read's outcome: the size read, or "corrupt" | "truncated" | "missing" | "unreadable"
log = logging.getLogger("kvledger.store")


class Location(NamedTuple):
    """Where a block's bytes are: `size` bytes at byte `offset` of segment file `name` (relative to the
    segments folder), hashing to `xxh` (xxh3-64). A tuple: one is made per block read."""

    name: str
    offset: int
    size: int
    xxh: int

    def pack(self) -> bytes:
        """The bytes a shared index keeps (offset u64 LE, then the name; size and xxh travel in the metadata)."""
        return OFFSET.pack(self.offset) + self.name.encode()

    @classmethod
    def unpack(cls, raw: bytes, size: int, xxh: int) -> Location | None:
        """The inverse of `pack` for a flat folder's name (None when `raw` does not parse)."""
        if len(raw) <= OFFSET.size:
            return None
        try:
            name = raw[OFFSET.size:].decode()
        except UnicodeDecodeError:
            return None
        return None if "/" in name else cls(name, OFFSET.unpack_from(raw)[0], size, xxh)


class SegmentFiles:
    """The files under `root/segments` (created when missing)."""

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.seg_dir = root / "segments"
        private_dir(self.seg_dir)   # 0700, and its files 0600: whatever the writer's umask (DESIGN)
        self.fsync = fsync
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._io_lock = threading.Lock()   # the descriptor cache is shared by this process's threads

    # --- the directory ---------------------------------------------------------------

    def names(self) -> set[str]:
        return {n for n in os.listdir(self.seg_dir) if n.endswith(sg.SUFFIX)}

    def remove_stale_tmp(self, max_age_s: float | None = None) -> None:
        """Temporary files of writers that died mid-write (never renamed in): those of dead processes of
        this host, and with `max_age_s` those of any host older than that (a shared mount)."""
        for name in os.listdir(self.seg_dir):
            if not name.startswith(".tmp-"):
                continue
            parts = name.split("-")
            dead = len(parts) >= 4 and parts[1] == HOST and parts[2].isdigit() and not pid_alive(int(parts[2]))
            with suppress(OSError):
                old = max_age_s is not None and time.time() - os.stat(self.seg_dir / name).st_mtime > max_age_s
                if dead or old:
                    os.unlink(self.seg_dir / name)

    # --- whole segments -----------------------------------------------------------------

    def read_meta(self, name: str) -> tuple[sg.SegmentMeta, int] | None:
        """(metadata, file size) of a segment; None when it is gone; `sg.BadSegment` when unreadable."""
        try:
            fd = os.open(self.seg_dir / name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return sg.read_meta(fd), os.fstat(fd).st_size
        finally:
            os.close(fd)

    def write(self, write: ChainWrite, sel: Sequence[int], views: Sequence[memoryview], now: float
              ) -> tuple[str, list[tuple[bytes, bytes, int, int, int, int]]]:
        """Write a new segment of the blocks `sel` of `write` all or nothing (`write_segment`); (its name, its
        ENTRY rows)."""
        tag = f"{HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        name = f"{time.time_ns():020d}-{tag}{sg.SUFFIX}"
        tmp = self.seg_dir / f".tmp-{tag}"
        try:
            fd = open_private(tmp, os.O_WRONLY | os.O_EXCL)
            try:
                rows, _ = write_segment(fd, write, sel, views, now)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.seg_dir / name)  # the directory is not fsynced: losing the rename to a power
        except OSError:                          # cut loses the segment (a miss), never corrupts it
            with suppress(OSError):
                os.unlink(tmp)
            raise
        return name, rows

    def cut(self, name: str, end: int) -> None:
        """Truncate a segment after byte `end` (GC of a chain's tail)."""
        os.truncate(self.seg_dir / name, end)

    def unlink(self, name: str) -> None:
        self.close_fd(name)
        with suppress(FileNotFoundError):
            os.unlink(self.seg_dir / name)

    # --- block bytes -----------------------------------------------------------------------

    def read_blocks(self, located: Sequence[tuple[int, Location]], bufs: Sequence[Any],
                    on_part: PartDone | None = None) -> list[Outcome]:
        """Read each (i, location) into `bufs[i]`; one outcome per item, in order (see the module docstring).
        One preadv per run of blocks back to back in one file (in the order given); `ValueError` for a buffer
        smaller than its block. With `on_part`, part by part instead (`read_by_part`)."""
        if on_part is not None:
            return self.read_by_part(located, bufs, on_part)
        out: list[Outcome] = []
        run: list[tuple[int, Location]] = []
        with self._io_lock:
            for item in located:
                last = run[-1][1] if run else None
                if last is not None and (last.name != item[1].name or last.offset + last.size != item[1].offset
                                         or len(run) >= IOV_MAX):
                    out += self._read_run(run, bufs)
                    run = []
                run.append(item)
            if run:
                out += self._read_run(run, bufs)
        return out

    def _read_run(self, run: list[tuple[int, Location]], bufs: Sequence[Any]) -> list[Outcome]:
        """One run, a piece (`READ_PIECE_BYTES`) at a time: while this thread checks piece k, a helper thread reads
        piece k + 1 (a preadv holds no GIL; a hash does), so the checks overlap the reads."""
        name = run[0][1].name
        dests = read_views(run, bufs)
        spans = pieces(dests, READ_PIECE_BYTES)

        def read(k: int) -> int:
            lo, hi = spans[k]
            return self.read_into(name, [p for d in dests[lo:hi] for p in d], run[lo][1].offset)

        out: list[Outcome] = []
        pending: Future[int] | None = None
        try:
            got = read(0)
            for k, (lo, hi) in enumerate(spans):
                if pending is not None:
                    got = pending.result()
                    pending = None
                start, last = run[lo][1].offset, run[hi - 1][1]
                whole = got >= last.offset + last.size - start
                if whole and k + 1 < len(spans):
                    pending = background().submit(read, k + 1)
                out += [_checked(loc, d, got >= loc.offset + loc.size - start, name)
                        for (_, loc), d in zip(run[lo:hi], dests[lo:hi])]
                if not whole:   # end of file: the rest of the run is gone
                    return out + ["truncated"] * (len(run) - hi)
        except FileNotFoundError:
            return ["missing"] * len(run)
        except OSError as err:   # a local error, on a fresh descriptor too: dropped, the next read opens again
            log.warning("read of segment %s failed: %s", name, err)
            self._drop_fd(name)
            return ["unreadable"] * len(run)
        finally:
            if pending is not None:   # never leave a read running into the caller's buffers
                wait([pending])
        return out

    def read_by_part(self, located: Sequence[tuple[int, Location]], bufs: Sequence[Any],
                     on_part: PartDone) -> list[Outcome]:
        """`read_blocks`, part-major: part 0 of every block, then part 1, ..., each block's xxh3-64 fed part by
        part (so it is the same hash), and `on_part(k)` once parts [0, k) of every block still being read are in.
        A reader may use those parts before the outcomes are known; only the outcomes say which blocks are intact
        (a block is checked when its last part is in). One pread per (block, part): for a consumer that computes
        with part k while part k + 1 is read (the engine's forward, layer by layer: `engine/fetcher.py`)."""
        dests = [dest_parts(bufs[i], loc.size, i) for i, loc in located]
        hashers = [xxhash.xxh3_64() for _ in located]
        out: list[Outcome | None] = [None] * len(located)
        offsets = [loc.offset for _, loc in located]
        with self._io_lock:
            self._will_need(located)
            for k in range(max((len(d) for d in dests), default=0)):
                for j, (_, loc) in enumerate(located):
                    if out[j] is not None or k >= len(dests[j]):
                        continue
                    view = dests[j][k]
                    try:
                        got = self.read_into(loc.name, [view], offsets[j])
                    except FileNotFoundError:
                        out[j] = "missing"
                        continue
                    except OSError as err:   # as in `_read_run`: dropped, the next read opens again
                        log.warning("read of segment %s failed: %s", loc.name, err)
                        self._drop_fd(loc.name)
                        out[j] = "unreadable"
                        continue
                    if got < view.nbytes:
                        out[j] = "truncated"
                        continue
                    hashers[j].update(view)
                    offsets[j] += got
                    if k + 1 == len(dests[j]) and hashers[j].intdigest() != loc.xxh:
                        log.warning("the block at %d of segment %s fails its checksum", loc.offset, loc.name)
                        out[j] = "corrupt"
                on_part(k + 1)
        return [loc.size if o is None else o for o, (_, loc) in zip(out, located)]

    def _will_need(self, located: Sequence[tuple[int, Location]]) -> None:
        """Start the kernel reading every block's bytes now, in file order (`POSIX_FADV_WILLNEED`), so that a read
        part by part, which jumps through the blocks, waits for the disk no longer than one read in order would
        (without it, 30 parts × 32 blocks of SmolLM2 from a cold page cache took 1.1-1.3× as long). A file that
        cannot be opened or advised is left to the reads (they report it)."""
        for _, loc in located:
            with suppress(OSError):
                os.posix_fadvise(self._fd(loc.name), loc.offset, loc.size, os.POSIX_FADV_WILLNEED)

    def read_into(self, name: str, views: list[memoryview], offset: int) -> int:
        """Fill `views` from `offset` of segment `name`; the bytes read (fewer only at end of file). A cached
        descriptor that fails is dropped and the file opened again, once: its mount may have died and been
        mounted again at the same path since (a descriptor of the dead one fails forever). A fresh
        descriptor's error is raised (the caller drops it)."""
        cached = name in self._fds
        try:
            return preadv_all(self._fd(name), views, offset)
        except OSError:
            if not cached:
                raise
            self._drop_fd(name)
        return preadv_all(self._fd(name), views, offset)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        fd = os.open(self.seg_dir / name, os.O_RDONLY)
        self._fds[name] = fd
        while len(self._fds) > MAX_OPEN_FDS:
            close_quietly(self._fds.popitem(last=False)[1])
        return fd

    def _drop_fd(self, name: str) -> None:
        """Forget (and close) the cached descriptor of `name`; the caller holds `_io_lock`."""
        fd = self._fds.pop(name, None)
        if fd is not None:
            close_quietly(fd)

    def close_fd(self, name: str) -> None:
        with self._io_lock:
            self._drop_fd(name)

    def close(self) -> None:
        """Close every cached descriptor; never raises (a dead mount fails close() with ENOTCONN)."""
        with self._io_lock:
            for fd in self._fds.values():
                close_quietly(fd)
            self._fds.clear()

# --- helpers -------------------------------------------------------------------------------

def _checked(loc: Location, parts: Sequence[memoryview], whole: bool, name: str) -> Outcome:
    """A block's outcome once read into `parts`: "truncated" unless `whole`, "corrupt" unless its xxh3-64 matches."""
    if not whole:
        return "truncated"
    if xxh3_of(parts) != loc.xxh:
        log.warning("the block at %d of segment %s fails its checksum", loc.offset, name)
        return "corrupt"
    return loc.size


def xxh3_of(parts: Sequence[memoryview]) -> int:
    """xxh3-64 of the parts' bytes one after another: the same value as of those bytes in one buffer."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def pieces(items: Sequence[memoryview | Sequence[memoryview]], piece_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of `items` (buffers, or blocks as lists of their parts), in order, each at least `piece_bytes`
    long (the last one may be shorter) and of at most IOV_MAX buffers in all (an item of more stands alone): the grain
    at which a run is read and checked, or hashed and written."""
    out, lo, size, iov = [], 0, 0, 0
    for i, item in enumerate(items):
        parts = (item,) if isinstance(item, memoryview) else item
        if iov + len(parts) > IOV_MAX and i > lo:
            out.append((lo, i))
            lo, size, iov = i, 0, 0
        size += sum(p.nbytes for p in parts)
        iov += len(parts)
        if size >= piece_bytes or iov >= IOV_MAX:
            out.append((lo, i + 1))
            lo, size, iov = i + 1, 0, 0
    if lo < len(items):
        out.append((lo, len(items)))
    return out


def close_quietly(fd: int) -> None:
    """Close `fd`; a fault is logged, never raised: the descriptor is released either way (close(2)), and on a
    dead mount (ENOTCONN, EIO) there is nothing left to flush for a read-only one."""
    try:
        os.close(fd)
    except OSError as e:
        log.info("close of a segment descriptor failed: %s", e)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def bytes_view(buf: Any, writable: bool = False) -> memoryview:
    """A flat byte view of any buffer (bytearray, memoryview, numpy array)."""
    v = memoryview(buf)
    if writable and v.readonly:
        raise ValueError("read buffers must be writable")
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def read_views(run: Sequence[tuple[int, Any]], bufs: Sequence[Any]) -> list[list[memoryview]]:
    """The destinations of a run of blocks read back to back: for each (i, record), `record.size` bytes of `bufs[i]`
    as its parts (`dest_parts`)."""
    return [dest_parts(bufs[i], rec.size, i) for i, rec in run]


def dest_buffers(dest: Any) -> Sequence[Any]:
    """The buffers of a read destination (`backend.Dest`): its parts, or the one buffer it is."""
    return dest if isinstance(dest, (tuple, list)) else (dest,)


def dest_bytes(dest: Any) -> int:
    """How many bytes a read destination (`dest_parts`), or any one buffer, holds."""
    return sum(memoryview(b).nbytes for b in dest_buffers(dest))


def dest_parts(dest: Any, size: int, i: int = 0) -> list[memoryview]:
    """The first `size` bytes of a read destination (`backend.Dest`: one writable buffer, or a tuple of them filled
    in order; a list works too) as flat byte views; `ValueError` when it holds fewer."""
    parts, left = [], size
    for buf in dest_buffers(dest):
        if left == 0:
            break
        v = bytes_view(buf, writable=True)[:left]
        parts.append(v)
        left -= v.nbytes
    if left:
        raise ValueError(f"buffer {i} holds {size - left} bytes, the block {size}")
    return parts


def write_segment(fd: int, write: ChainWrite, sel: Sequence[int], views: Sequence[memoryview], now: float
                  ) -> tuple[list[tuple[bytes, bytes, int, int, int, int]], int]:
    """Write the segment of the blocks `sel` of `write` (their bytes `views`) into the empty file `fd`: the blocks
    from `data_off` on, a piece at a time, this thread hashing piece k while a helper thread writes piece k - 1 (a
    pwritev holds no GIL; a hash does), then the metadata, which holds those hashes, at 0. (ENTRY rows, file
    size), as `segment.encode_chain`; the file's bytes are the same as if written in one go."""
    offset = sg.data_offset(write, len(sel))
    spans = pieces(views, WRITE_PIECE_BYTES)
    xxhs: list[int] = []
    pending: Future[None] | None = None
    try:
        for lo, hi in spans:
            piece = list(views[lo:hi])
            xxhs += [xxhash.xxh3_64_intdigest(v) for v in piece]
            if pending is not None:
                pending.result()
            if len(spans) == 1:
                pwritev_all(fd, piece, offset)
            else:
                pending = background().submit(pwritev_all, fd, piece, offset)
            offset += sum(v.nbytes for v in piece)
        if pending is not None:
            pending.result()
    finally:
        if pending is not None:   # never leave a write running on a descriptor the caller is about to close
            wait([pending])
    meta, rows, size = sg.encode_chain(write, sel, views, now, xxhs)
    pwritev_all(fd, [memoryview(meta)], 0)
    return rows, size


def background() -> ThreadPoolExecutor:
    """This process's helper threads for the piece-by-piece reads and writes (made on first use; a forked child,
    whose copy of them has no threads, makes its own)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None or _helpers[0] != os.getpid():
            _helpers = (os.getpid(), ThreadPoolExecutor(max_workers=HELPER_THREADS,
                                                         thread_name_prefix="kvledger-store-io"))
        return _helpers[1]


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write all of `views` in order from `offset`, IOV_MAX buffers per syscall, resuming after short writes."""
    i = 0
    views = list(views)
    while i < len(views):
        n = os.pwritev(fd, views[i:i + IOV_MAX], offset)
        offset += n
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]


def preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill `views` from `offset`; the number of bytes read (less than asked only at end of file)."""
    total = 0
    i = 0
    views = list(views)
    while i < len(views):
        n = os.preadv(fd, views[i:i + IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]
    return total
