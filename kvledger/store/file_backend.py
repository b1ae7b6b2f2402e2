"""The embedded block store: segment files in a directory, metadata indexed in the process.

Write path: the blocks of one put call go into one new segment (segment.py), written with
`writev` under a temporary name, fsynced once, renamed into place (all or nothing). Any byte
that does reach the disk wrong (power cut, bit rot) fails its checksum on read: a miss. Writers
of one directory serialize on an flock of `DIR/.lock` and re-read the directory first, so
two processes storing the same chain write each block once.

Read path: blocks of a prefix that lie back to back in a segment are read with one
`preadv` straight into the caller's buffers; each is checked against its xxh3-64. A
mismatch or a short read is a miss (counted), and the entry is dropped.

Index: rebuilt from the segments' metadata at open (no block byte is read), kept current
with other writers by re-listing the directory when its mtime changes.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from collections.abc import Iterator

import xxhash

from kvledger.store import gc as gcplan
from kvledger.store import segment as sg
from kvledger.store.backend import (
    Buffer,
    ChainWrite,
    Counters,
    GcResult,
    PutResult,
    StoreStats,
    VerifyResult,
    stored_name,
)
from kvledger.store.index import Entry, MemoryIndex, Segment
from kvledger.store.ttl import Clock, wall_clock

log = logging.getLogger("kvledger.store")

IOV_MAX = 1024
MAX_OPEN_FDS = 128
STALE_TMP_S = 3600.0  # verify removes temporary files of any host older than this
WRITEBACK_S = 5.0  # a hit's refreshed expiry reaches its segment file at most this long after the hit
_HOST = socket.gethostname().replace("-", "_")
_MTIME_SLACK_NS = 50_000_000  # a directory mtime younger than this may still change within its tick


class FileStore:
    """Blocks in segment files under `root/segments`; see the module docstring.

    `capacity_bytes`: when live bytes would exceed it, put evicts least recently hit blocks
    (tails first) down to `low_watermark` × capacity. `fsync=False` skips the fsyncs (tests).

    Durable refresh: a CHECK refreshes expiries in memory only (no I/O on its path); a writer
    thread, started by the first hit, writes the refreshed segments back every `writeback_s`
    seconds under the directory's flock, merged with what other processes wrote (the later
    expiry wins, a block another process removed stays removed). A hit is therefore durable for
    every process within `writeback_s` (default 5 s), and at `close`.
    """

    backend = "file"

    def __init__(self, root: str | os.PathLike, *, capacity_bytes: int | None = None, fsync: bool = True,
                 clock: Clock = wall_clock, create: bool = True, low_watermark: float = 0.9,
                 writeback_s: float = WRITEBACK_S) -> None:
        self.root = Path(root)
        if not create and not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such directory")
        self.seg_dir = self.root / "segments"
        self.seg_dir.mkdir(parents=True, exist_ok=True)
        if capacity_bytes is not None and not capacity_bytes >= 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes!r}")
        if not 0 < low_watermark <= 1 or not 0 < writeback_s < math.inf:
            raise ValueError("need 0 < low_watermark <= 1 and 0 < writeback_s < inf")
        self.writeback_s = writeback_s
        self._writer: threading.Thread | None = None
        self._closing = threading.Event()
        self._writer_lock = threading.Lock()
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.fsync = fsync
        self.clock = clock
        self.counters = Counters()
        self.index = MemoryIndex()
        self.segments: dict[str, Segment] = {}
        self.bad_segments: list[str] = []
        self.duplicates = 0
        self.live_bytes = 0
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.RLock()
        self._dir_mtime: int | None = None
        self._lock_path = self.root / ".lock"
        self._remove_stale_tmp()
        self.refresh()

    # --- index upkeep ------------------------------------------------------------

    def refresh(self, force: bool = False) -> None:
        """Load segments other writers added and forget those they removed (one stat when nothing changed).

        Never waits: while another thread of this process holds the store (a put in its fsync), the
        index stays as it is for this call. `force` lists the directory whatever its mtime says."""
        try:
            mtime = os.stat(self.seg_dir).st_mtime_ns
        except OSError:
            return
        if mtime == self._dir_mtime and not force:
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            try:
                names = {n for n in os.listdir(self.seg_dir) if n.endswith(sg.SUFFIX)}
            except OSError as e:
                log.warning("cannot list %s: %s", self.seg_dir, e)
                return
            for name in [n for n in self.segments if n not in names]:
                self._forget_segment(self.segments[name])
            for name in sorted(names - self.segments.keys() - set(self.bad_segments)):
                self._load_segment(name)
            # an mtime inside the current clock tick may not change again for a later rename: look again
            self._dir_mtime = None if _now_ns() - mtime < _MTIME_SLACK_NS else mtime
        finally:
            self._lock.release()

    def _load_segment(self, name: str) -> None:
        path = self.seg_dir / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            meta = sg.read_meta(fd)
            file_size = os.fstat(fd).st_size
        except sg.BadSegment as e:
            log.warning("segment %s is bad (%s): ignored until `kvledger store verify` removes it", name, e)
            self.bad_segments.append(name)
            return
        except OSError as e:
            log.warning("cannot read segment %s: %s", name, e)
            return
        finally:
            os.close(fd)
        now = self.clock()
        seg = Segment(name, meta.namespace, meta.ttl_class, meta.ttl_s, meta.created,
                      meta.layout.mutable_off, file_size, [None] * meta.layout.n)
        for i, (key, parent, pos, size, xxh, offset) in enumerate(meta.entries):
            expiry, hit = meta.expiry[i], meta.last_hit[i]
            if not math.isfinite(expiry) or expiry < meta.created + meta.ttl_s:
                expiry = meta.created + meta.ttl_s
            if not math.isfinite(hit) or not meta.created <= hit <= expiry:
                hit = meta.created
            if meta.flags[i] != sg.FLAG_LIVE or offset + size > file_size:
                seg.trim = True
                continue
            if expiry < now:  # expired before we opened: gc removes it and counts it
                seg.trim = True
                seg.expired_at_open += 1
                continue
            if key in self.index.entries:
                self.duplicates += 1
                seg.trim = seg.dirty = True
                continue
            e = Entry(key, parent, pos, size, xxh, offset, seg, i, expiry, hit)
            seg.entries[i] = e
            self.index.entries[key] = e
            self.live_bytes += size
        self.segments[name] = seg

    def _forget_segment(self, seg: Segment) -> None:
        for e in seg.live():
            self._drop(e)
        self.segments.pop(seg.name, None)
        fd = self._fds.pop(seg.name, None)
        if fd is not None:
            os.close(fd)

    def _drop(self, e: Entry) -> None:
        if self.index.entries.get(e.key) is e:
            self.live_bytes -= e.size
        self.index.remove(e)

    def _remove_stale_tmp(self, max_age_s: float | None = None) -> None:
        """Temporary files of writers that died mid-write (never renamed in): those of dead processes of
        this host, and with `max_age_s` those of any host older than that (a shared mount)."""
        for name in os.listdir(self.seg_dir):
            if not name.startswith(".tmp-"):
                continue
            parts = name.split("-")
            dead = len(parts) >= 4 and parts[1] == _HOST and parts[2].isdigit() and not _pid_alive(int(parts[2]))
            with suppress(OSError):
                old = max_age_s is not None and _now_ns() / 1e9 - os.stat(self.seg_dir / name).st_mtime > max_age_s
                if dead or old:
                    os.unlink(self.seg_dir / name)

    # --- CHECK -----------------------------------------------------------------

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Leading present blocks, from the in-process index (no block byte read)."""
        self.refresh()
        n = self.index.match(keys, self.clock(), ttl_s)
        if n and self._writer is None:
            self._start_writer()
        return n

    def _start_writer(self) -> None:
        """The thread that makes refreshed expiries durable (see the class docstring)."""
        with self._writer_lock:  # not the store's lock: a CHECK never waits for a put
            if self._writer is not None or self._closing.is_set():
                return
            self._writer = threading.Thread(target=self._writeback_loop, name="kvledger-writeback", daemon=True)
            self._writer.start()

    def _writeback_loop(self) -> None:
        while not self._closing.wait(self.writeback_s):
            self.flush()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self.refresh()
        now = self.clock()
        get = self.index.entries.get
        out = []
        for k in keys:
            e = get(k)
            out.append(e is not None and e.expiry >= now)
        return out

    # --- write -----------------------------------------------------------------

    def put(self, write: ChainWrite) -> PutResult:
        n = len(write.keys)
        tmp: Path | None = None
        try:
            with self._lock, self._flock():
                self.refresh()
                now = self.clock()
                get = self.index.entries.get
                sel = []
                for i, k in enumerate(write.keys):
                    e = get(k)
                    if e is None or e.expiry < now:
                        sel.append(i)
                skipped = n - len(sel)
                self.counters.blocks_skipped += skipped
                if not sel:
                    return PutResult(0, skipped, 0)
                views = [_bytes_view(write.blocks[i]) for i in sel]
                incoming = sum(v.nbytes for v in views)
                if self.capacity_bytes is not None:
                    if incoming > self.capacity_bytes:
                        log.warning("put of %d bytes exceeds the store's capacity %d", incoming, self.capacity_bytes)
                        self.counters.put_failures += 1
                        return PutResult(0, skipped, len(sel))
                    if self.live_bytes + incoming > self.capacity_bytes:
                        target = int(self.capacity_bytes * self.low_watermark) - incoming
                        self._evict(self.live_bytes - max(target, 0))
                expiry = now + write.ttl_s
                rows: list[tuple[bytes, bytes, int, int, int, int]] = []
                ns_len, cls_len = len(stored_name(write.namespace)), len(stored_name(write.ttl_class))
                offset = sg.Layout.of(len(sel), ns_len, cls_len).data_off
                for i, v in zip(sel, views):
                    parent = write.keys[i - 1] if i > 0 else write.parent
                    rows.append((write.keys[i], parent, write.start_pos + i, v.nbytes, xxhash.xxh3_64_intdigest(v),
                                 offset))
                    offset += v.nbytes
                meta = sg.encode_meta(write.namespace, write.ttl_class, write.ttl_s, now, rows, [expiry] * len(rows))
                tag = f"{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
                name = f"{_now_ns():020d}-{tag}{sg.SUFFIX}"
                tmp = self.seg_dir / f".tmp-{tag}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    _writev_all(fd, [memoryview(meta), *views])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, self.seg_dir / name)  # the directory is not fsynced: losing the rename to a
                tmp = None                            # power cut loses the segment (a miss), never corrupts it
                seg = Segment(name, write.namespace, write.ttl_class, write.ttl_s, now,
                              sg.Layout.of(len(rows), ns_len, cls_len).mutable_off, offset, [None] * len(rows))
                for j, (key, parent, pos, size, xxh, off) in enumerate(rows):
                    e = Entry(key, parent, pos, size, xxh, off, seg, j, expiry, now)
                    seg.entries[j] = e
                    self._add(e)
                self.segments[name] = seg
                self.counters.blocks_written += len(rows)
                self.counters.bytes_written += incoming
                return PutResult(len(rows), skipped, 0)
        except OSError as e:
            log.warning("put of %d blocks to %s failed: %s", n, self.root, e)
            self.counters.put_failures += 1
            if tmp is not None:
                with suppress(OSError):
                    os.unlink(tmp)
            return PutResult(0, 0, n)

    def _add(self, e: Entry) -> None:
        old = self.index.entries.get(e.key)
        if old is not None:
            self._drop(old)
        self.index.entries[e.key] = e
        self.live_bytes += e.size

    # --- read ------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Buffer]) -> list[int]:
        """Read blocks into `bufs` (each at least the block's size); per key its size, or -1 for a miss."""
        assert len(keys) == len(bufs)
        out = [-1] * len(keys)
        with self._lock:
            self.refresh()
            now = self.clock()
            get = self.index.entries.get
            run: list[tuple[int, Entry]] = []
            for i, k in enumerate(keys):
                e = get(k)
                if e is None or e.expiry < now:
                    self.counters.misses_absent += 1
                    self._read_run(run, bufs, out)
                    run = []
                    continue
                if run and (run[-1][1].seg is not e.seg or run[-1][1].offset + run[-1][1].size != e.offset
                            or len(run) >= IOV_MAX):
                    self._read_run(run, bufs, out)
                    run = []
                run.append((i, e))
            self._read_run(run, bufs, out)
        return out

    def _read_run(self, run: list[tuple[int, Entry]], bufs: Sequence[Buffer], out: list[int],
                  drop: bool = True) -> None:
        if not run:
            return
        seg = run[0][1].seg
        views = []
        for i, e in run:
            v = _bytes_view(bufs[i], writable=True)
            assert v.nbytes >= e.size, "buffer smaller than the block"
            views.append(v[:e.size])
        try:
            fd = self._fd(seg.name)
            got = _preadv_all(fd, views, run[0][1].offset)
        except OSError as err:
            log.warning("read of segment %s failed: %s", seg.name, err)
            got = 0
        start = run[0][1].offset
        for (i, e), v in zip(run, views):
            if e.offset + e.size - start > got:
                self.counters.misses_truncated += 1
                if drop:
                    self._drop(e)
            elif xxhash.xxh3_64_intdigest(v) != e.xxh:
                self.counters.misses_corrupt += 1
                log.warning("block %s of segment %s fails its checksum", e.key.hex(), seg.name)
                if drop:
                    self._drop(e)
            else:
                out[i] = e.size
                self.counters.blocks_read += 1
                self.counters.bytes_read += e.size

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        fd = os.open(self.seg_dir / name, os.O_RDONLY)
        self._fds[name] = fd
        while len(self._fds) > MAX_OPEN_FDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    # --- removal, GC, eviction ---------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            victims = [e for k in keys if (e := self.index.entries.get(k)) is not None]
            for e in victims:
                self._drop(e)
            try:
                with self._flock():
                    self._reclaim({e.seg for e in victims})
            except OSError as err:
                log.warning("delete in %s: reclaiming failed: %s", self.root, err)
        return len(victims)

    def gc(self, batch: int = 4096) -> GcResult:
        """Remove expired blocks (tails first, `batch` at a time), then evict down to capacity."""
        freed0 = self._disk_bytes()
        n_batches = 0
        try:
            with self._lock, self._flock():
                self.refresh()
                for seg in list(self.segments.values()):  # other processes' refreshes and removals count
                    self._merge_mutable(seg)
                due = gcplan.expired_tails_first(self.index.entries.values(), self.clock())
                at_open = sum(s.expired_at_open for s in self.segments.values())
                for chunk in gcplan.batches(due, batch):
                    for e in chunk:
                        self._drop(e)
                    self._reclaim({e.seg for e in chunk})
                    n_batches += 1
                self.counters.gc_expired += len(due) + at_open
                evicted = 0
                if self.capacity_bytes is not None and self.live_bytes > self.capacity_bytes:
                    evicted = self._evict(self.live_bytes - int(self.capacity_bytes * self.low_watermark))
                    n_batches += 1
                self._reclaim({s for s in self.segments.values() if s.trim})
                for seg in self.segments.values():
                    seg.expired_at_open = 0
                self._flush()
        except OSError as e:
            log.warning("gc of %s stopped: %s", self.root, e)
            return GcResult(0, 0, 0, n_batches)
        return GcResult(len(due) + at_open, evicted, max(freed0 - self._disk_bytes(), 0), n_batches)

    def _evict(self, need_bytes: int) -> int:
        victims = gcplan.lru_tails_first(self.index.entries.values(), need_bytes)
        for e in victims:
            self._drop(e)
        self._reclaim({e.seg for e in victims})
        self.counters.gc_evicted += len(victims)
        return len(victims)

    def _reclaim(self, segs: set[Segment]) -> None:
        """Persist dead flags, then cut each segment after its last live block (or unlink it)."""
        for seg in segs:
            if seg.name not in self.segments:
                continue
            path = self.seg_dir / seg.name
            self._merge_mutable(seg)
            if seg.name not in self.segments:
                continue
            last = max((e.idx for e in seg.live()), default=None)
            if last is None:
                fd = self._fds.pop(seg.name, None)
                if fd is not None:
                    os.close(fd)
                with suppress(FileNotFoundError):
                    os.unlink(path)
                del self.segments[seg.name]
                continue
            self._write_mutable(seg)
            e = seg.entries[last]
            end = e.offset + e.size
            if end < seg.file_size:
                os.truncate(path, end)
                seg.file_size = end
            seg.trim = False

    def _merge_mutable(self, seg: Segment) -> None:
        """Take in what other processes wrote to `seg`'s mutable arrays: a later expiry or last hit wins,
        a block flagged dead is dropped. A segment that vanished is forgotten."""
        n = len(seg.entries)
        try:
            fd = os.open(self.seg_dir / seg.name, os.O_RDONLY)
        except FileNotFoundError:
            self._forget_segment(seg)
            return
        try:
            raw = os.pread(fd, 17 * n, seg.mutable_off)
        finally:
            os.close(fd)
        if len(raw) < 17 * n:
            return
        exp = memoryview(raw)[:8 * n].cast("d")
        hit = memoryview(raw)[8 * n:16 * n].cast("d")
        for i, e in enumerate(seg.entries):
            if e is None:
                continue
            if raw[16 * n + i] != sg.FLAG_LIVE:
                self._drop(e)
                continue
            if math.isfinite(exp[i]) and exp[i] > e.expiry:
                e.expiry = exp[i]
            if math.isfinite(hit[i]) and e.last_hit < hit[i] <= e.expiry:
                e.last_hit = hit[i]

    def _write_mutable(self, seg: Segment) -> None:
        """Write `seg`'s expiries, last hits and flags back, merged first with what is on disk.

        The caller holds the directory's flock (so no other process writes them meanwhile)."""
        seg.dirty = False  # before reading the values: a hit racing this write marks it dirty again
        self._merge_mutable(seg)
        if seg.name not in self.segments:
            return
        n = len(seg.entries)
        buf = bytearray(17 * n)
        exp = memoryview(buf)[:8 * n].cast("d")
        hit = memoryview(buf)[8 * n:16 * n].cast("d")
        for i, e in enumerate(seg.entries):
            if e is None:
                exp[i], hit[i] = seg.created + seg.ttl_s, seg.created
                buf[16 * n + i] = sg.FLAG_DEAD
            else:
                exp[i], hit[i] = e.expiry, e.last_hit
        fd = os.open(self.seg_dir / seg.name, os.O_WRONLY)
        try:
            os.pwrite(fd, buf, seg.mutable_off)
        finally:
            os.close(fd)

    def _flush(self) -> None:
        """Write refreshed expiries and last hits back to their segments (the caller holds the flock)."""
        for seg in list(self.segments.values()):
            if seg.dirty:
                try:
                    self._write_mutable(seg)
                except FileNotFoundError:
                    self._forget_segment(seg)

    def flush(self) -> None:
        with self._lock:
            if not any(seg.dirty for seg in self.segments.values()):
                return
            try:
                with self._flock():
                    self._flush()
            except OSError as e:
                log.warning("flush of %s failed: %s", self.root, e)

    # --- operator views ------------------------------------------------------------

    def _disk_bytes(self) -> int:
        return sum(s.file_size for s in self.segments.values())

    def stats(self) -> StoreStats:
        with self._lock:
            self.refresh()
            st = StoreStats(self.backend, str(self.root), capacity_bytes=self.capacity_bytes)
            entries = self.index.entries
            parents = {e.parent for e in entries.values()}
            st.blocks = len(entries)
            st.chains = sum(1 for k in entries if k not in parents)
            st.live_bytes = self.live_bytes
            st.disk_bytes = self._disk_bytes()
            st.segments = len(self.segments)
            for e in entries.values():
                s = e.seg
                st.per_class[s.ttl_class] = st.per_class.get(s.ttl_class, 0) + 1
                st.per_namespace[s.namespace] = st.per_namespace.get(s.namespace, 0) + 1
            live_segs = [s for s in self.segments.values() if any(True for _ in s.live())]
            st.oldest_created = min((s.created for s in live_segs), default=None)
            st.next_expiry = min((e.expiry for e in entries.values()), default=None)
            st.counters = self.counters.as_dict() | {"duplicates": self.duplicates,
                                                     "bad_segments": len(self.bad_segments)}
            return st

    def verify(self, remove: bool = True) -> VerifyResult:
        """Read every live block and check it; bad blocks (and unreadable segments) are reported and removed."""
        checked = bad = removed = nbytes = 0
        with self._lock:
            self.refresh()
            for seg in list(self.segments.values()):
                live = sorted(seg.live(), key=lambda e: e.idx)
                for chunk in gcplan.batches(live, 256):
                    bufs = [bytearray(e.size) for e in chunk]
                    res = [-1] * len(chunk)
                    run: list[tuple[int, Entry]] = []
                    for i, e in enumerate(chunk):
                        if run and run[-1][1].offset + run[-1][1].size != e.offset:
                            self._read_run(run, bufs, res, drop=remove)
                            run = []
                        run.append((i, e))
                    self._read_run(run, bufs, res, drop=remove)
                    checked += len(chunk)
                    nbytes += sum(r for r in res if r > 0)
                    bad += res.count(-1)
                if remove and seg.trim:
                    with self._flock():
                        self._reclaim({seg})
            removed = bad if remove else 0
            if remove:
                self._remove_stale_tmp(max_age_s=STALE_TMP_S)
            for name in list(self.bad_segments):
                bad += 1
                if remove:
                    with suppress(OSError):
                        os.unlink(self.seg_dir / name)
                        removed += 1
                    self.bad_segments.remove(name)
        return VerifyResult(checked, bad, removed, nbytes)

    def close(self) -> None:
        with self._writer_lock:
            self._closing.set()
        if self._writer is not None:
            self._writer.join()
        with self._lock:
            self.flush()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> FileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _flock(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


# --- helpers -------------------------------------------------------------------------

def _now_ns() -> int:
    import time

    return time.time_ns()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bytes_view(buf: Buffer, writable: bool = False) -> memoryview:
    v = memoryview(buf)
    if writable and v.readonly:
        raise ValueError("read buffers must be writable")
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """Write all of `views` in order, IOV_MAX buffers per syscall, resuming after short writes."""
    i = 0
    while i < len(views):
        chunk = views[i:i + IOV_MAX]
        n = os.writev(fd, chunk)
        for v in chunk:
            if n >= v.nbytes:
                n -= v.nbytes
                i += 1
            else:
                views[i] = v[n:]
                break


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
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
