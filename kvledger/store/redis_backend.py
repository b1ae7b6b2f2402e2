"""The block store on a Redis server: the shared index of the cluster mode, and the block
bytes too for small deployments.

One Redis hash per block, `{prefix}b:<16-byte key>` with fields `m` (metadata, a packed
struct — never pickle) and `d` (the bytes). Expiry is Redis's own: the blocks of one put (or
one hit) at chain positions p expire at the same instant minus p milliseconds, so along a chain
every tail expires before its head and a reader never sees a block whose parent has expired
(tails first, by construction). A chain extended by a later put can leave a tail that outlives
its head; it cannot be matched (CHECK walks from the head) and expires on its own.

CHECK is one Lua call: the keys travel as one concatenated argument; the script walks them,
refreshes each present block's expiry (`PEXPIREAT … GT` from one `TIME`, never shortening it) and stops at the
first absent one. One round trip, one integer back, no block byte touched.

Cluster mode (`files=` a FileStore on a shared mount: 3FS, CephFS, NFS): Redis holds only the
metadata and answers CHECK for every entrypoint; the bytes go to segment files that every
engine reads. Bytes are written before their metadata is published, and a file block lives
until GC finds that Redis no longer knows its key (expired or deleted).

Every call has a socket timeout; any Redis or socket error is logged and counted and turns
into a miss (`match` → 0, `get_into` → -1, `put` → failed), never an exception.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvledger.store.backend import (
    BlockInfo,
    BlockStore,
    Buffer,
    ChainWrite,
    Counters,
    GcResult,
    PutResult,
    StoreStats,
    VerifyResult,
)
from kvledger.store.redis_meta import EXISTS, MATCH, PUT, MetaFields, decode_meta, encode_meta

log = logging.getLogger("kvledger.store")

PUT_CHUNK_BYTES = 16 << 20           # bytes of one pipelined put/get round trip
FAULTS = (redis.RedisError, OSError)
FILE_TTL_S = 100 * 365 * 86_400.0  # bytes on files in the cluster mode live until Redis forgets their block
GC_GRACE_S = 60.0                  # cluster-mode GC spares file blocks younger than this (published any moment)


class RedisStore:
    """Blocks and their metadata on the Redis server at `url` (see the module docstring)."""

    backend = "redis"

    def __init__(self, url: str, *, prefix: str = "kvl:", timeout_s: float = 2.0, check: bool = False,
                 files: BlockStore | None = None) -> None:
        self.url = url
        self.files = files
        self.prefix = prefix.encode()
        self.bprefix = self.prefix + b"b:"
        self.counters = Counters()
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._match = self.r.register_script(MATCH)
        self._exists = self.r.register_script(EXISTS)
        self._put = self.r.register_script(PUT)
        if check:
            self.r.ping()  # raises: for the CLI, which reports an unreachable server as bad input

    def _k(self, key: bytes) -> bytes:
        return self.bprefix + key

    # --- CHECK -----------------------------------------------------------------

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        if not keys:
            return 0
        try:
            return int(self._match(args=[b"".join(keys), int(ttl_s * 1000), self.bprefix]))
        except FAULTS as e:
            log.warning("CHECK on %s failed (answering 0): %s", self.url, e)
            self.counters.match_failures += 1
            return 0

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            bits = self._exists(args=[b"".join(keys), self.bprefix])
        except FAULTS as e:
            log.warning("exists on %s failed: %s", self.url, e)
            self.counters.exists_failures += 1
            return [False] * len(keys)
        return [c == ord("1") for c in bits]

    # --- write -----------------------------------------------------------------

    def put(self, write: ChainWrite) -> PutResult:
        n = len(write.keys)
        present = self.exists(write.keys)
        sel = [i for i in range(n) if not present[i]]
        skipped = n - len(sel)
        written = 0
        now = time.time()
        if self.files is not None and sel:
            on_files = self.files.put(ChainWrite(write.keys, write.blocks, write.start_pos, write.parent,
                                                 write.namespace, write.ttl_class, FILE_TTL_S))
            if on_files.failed:
                self.counters.put_failures += 1
                return PutResult(0, skipped, len(sel))
        expire_at_ms = int((now + write.ttl_s) * 1000)  # one clock for the whole put: the skew orders it exactly
        try:
            pipe = self.r.pipeline(transaction=False)
            pending = 0
            for i in sel:
                v = memoryview(write.blocks[i]).cast("B")
                parent = write.keys[i - 1] if i > 0 else write.parent
                pos = write.start_pos + i
                meta = encode_meta(parent, pos, v.nbytes, xxhash.xxh3_64_intdigest(v), now, write.ttl_s,
                                   write.namespace, write.ttl_class)
                data = b"" if self.files is not None else v
                self._put(keys=[self._k(write.keys[i])], args=[meta, data, expire_at_ms - pos], client=pipe)
                pending += v.nbytes
                if pending >= PUT_CHUNK_BYTES:
                    written += sum(int(x) for x in pipe.execute())
                    pending = 0
            written += sum(int(x) for x in pipe.execute())
        except FAULTS as e:
            log.warning("put of %d blocks to %s failed: %s", len(sel), self.url, e)
            self.counters.put_failures += 1
            self.counters.blocks_written += written
            return PutResult(written, skipped, len(sel) - written)
        self.counters.blocks_written += written
        self.counters.blocks_skipped += skipped + len(sel) - written
        self.counters.bytes_written += sum(memoryview(write.blocks[i]).nbytes for i in sel)
        return PutResult(written, skipped + len(sel) - written, 0)

    # --- read ------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Buffer]) -> list[int]:
        if len(keys) != len(bufs):
            raise ValueError(f"one buffer per key: {len(keys)} keys, {len(bufs)} buffers")
        if self.files is not None:
            return self._get_from_files(keys, bufs)
        out = [-1] * len(keys)
        i = 0
        while i < len(keys):
            j = i
            budget = 0
            try:
                pipe = self.r.pipeline(transaction=False)
                while j < len(keys) and budget < PUT_CHUNK_BYTES:
                    pipe.hmget(self._k(keys[j]), "m", "d")
                    budget += memoryview(bufs[j]).nbytes
                    j += 1
                replies = pipe.execute()
            except FAULTS as e:
                log.warning("get from %s failed: %s", self.url, e)
                self.counters.misses_absent += len(keys) - i
                return out
            for k, (m, d) in zip(range(i, j), replies):
                out[k] = self._check_copy(keys[k], m, d, bufs[k])
            i = j
        return out

    def _get_from_files(self, keys: Sequence[bytes], bufs: Sequence[Buffer]) -> list[int]:
        """Cluster mode: Redis decides which blocks are live (the files keep bytes Redis may have expired),
        the files give the bytes. One EXISTS round trip, then the reads."""
        out = [-1] * len(keys)
        live = [i for i, alive in enumerate(self.exists(keys)) if alive]
        self.counters.misses_absent += len(keys) - len(live)
        if not live:
            return out
        for i, size in zip(live, self.files.get_into([keys[i] for i in live], [bufs[i] for i in live])):
            out[i] = size
        again = [i for i in live if out[i] < 0]
        if again:  # another machine's segment may be newer than our listing: look again
            self.files.refresh(force=True)
            for i, size in zip(again, self.files.get_into([keys[i] for i in again], [bufs[i] for i in again])):
                out[i] = size
        lost = [self._k(keys[i]) for i in again if out[i] < 0]
        if lost:  # published but unreadable here: unpublish, so the next put writes them again
            with contextlib.suppress(*FAULTS):
                self.r.delete(*lost)
        return out

    def _check_copy(self, key: bytes, m: bytes | None, d: bytes | None, buf: Buffer) -> int:
        if m is None or d is None:
            self.counters.misses_absent += 1
            return -1
        meta = decode_meta(m)
        if meta is None or len(d) != meta[2] or xxhash.xxh3_64_intdigest(d) != meta[3]:
            self.counters.misses_corrupt += 1
            log.warning("block %s on %s fails its checksum: deleted", key.hex(), self.url)
            with contextlib.suppress(*FAULTS):
                self.r.delete(self._k(key))
            return -1
        v = memoryview(buf).cast("B")
        if v.nbytes < len(d):
            raise ValueError(f"a buffer holds {v.nbytes} bytes, the block {len(d)}")
        v[:len(d)] = d
        self.counters.blocks_read += 1
        self.counters.bytes_read += len(d)
        return len(d)

    # --- removal and operator views ----------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        if self.files is not None:
            self.files.delete(keys)
        try:
            return int(self.r.delete(*[self._k(k) for k in keys]))
        except FAULTS as e:
            log.warning("delete on %s failed: %s", self.url, e)
            return 0

    def _scan_names(self, batch: int) -> Iterator[list[bytes]]:
        """The Redis keys of every block, `batch` at a time (the one SCAN loop)."""
        cursor = 0
        while True:
            cursor, names = self.r.scan(cursor, match=self.bprefix + b"*", count=batch)
            if names:
                yield names
            if cursor == 0:
                return

    def _scan(self, batch: int = 1000) -> Iterator[tuple[bytes, MetaFields | None, int]]:
        """(redis key, meta fields or None, ms to live) of every block, `batch` keys per round trip."""
        for names in self._scan_names(batch):
            pipe = self.r.pipeline(transaction=False)
            for name in names:
                pipe.hget(name, "m")
                pipe.pttl(name)
            res = pipe.execute()
            for name, m, ttl in zip(names, res[0::2], res[1::2]):
                yield name, (decode_meta(m) if m is not None else None), ttl

    def blocks(self) -> Iterator[BlockInfo]:
        now = time.time()
        for name, meta, ttl in self._scan_soft():
            if meta is not None:
                parent, pos, size, _, created, _, ns, cls = meta
                expiry = now + ttl / 1000 if ttl >= 0 else None
                yield BlockInfo(name[len(self.bprefix):], parent, pos, size, created, expiry, ns, cls)

    def refresh(self, force: bool = False) -> None:
        """Every reader shares Redis: nothing to learn (the files, in the cluster mode, are refreshed on a miss)."""

    def _scan_soft(self, batch: int = 1000) -> Iterator[tuple[bytes, MetaFields | None, int]]:
        try:
            yield from self._scan(batch)
        except FAULTS as e:
            log.warning("scan of %s stopped: %s", self.url, e)

    def gc(self, batch: int = 1000) -> GcResult:
        """Expiry is Redis's own (tails first by construction); this removes blocks whose metadata is
        unreadable and, in the cluster mode, file blocks whose key Redis no longer holds (tails first)."""
        removed = batches = freed = 0
        try:
            bad = [name for name, meta, ttl in self._scan(batch) if meta is None and ttl != -2]
            for i in range(0, len(bad), batch):
                removed += int(self.r.delete(*bad[i:i + batch]))
                batches += 1
            if self.files is not None:
                removed_f, freed, b = self._gc_files(batch)
                removed += removed_f
                batches += b
        except FAULTS as e:
            log.warning("gc on %s stopped: %s", self.url, e)
        return GcResult(removed, 0, freed, batches)

    def _gc_files(self, batch: int) -> tuple[int, int, int]:
        files = self.files
        assert files is not None
        files.refresh(force=True)
        cutoff = time.time() - GC_GRACE_S
        entries = [b for b in files.blocks() if b.created < cutoff]
        gone = []
        for i in range(0, len(entries), batch):
            chunk = entries[i:i + batch]
            bits = self._exists(args=[b"".join(b.key for b in chunk), self.bprefix])  # raises: GC stops
            gone += [b for b, c in zip(chunk, bits) if c != ord("1")]
        gone.sort(key=lambda e: -e.pos)
        before = files.stats().disk_bytes
        batches = 0
        for i in range(0, len(gone), batch):
            files.delete([e.key for e in gone[i:i + batch]])
            batches += 1
        return len(gone), max(before - files.stats().disk_bytes, 0), batches

    def stats(self) -> StoreStats:
        """Figures of the blocks Redis holds (those counted before a fault, if the server goes away mid-scan)."""
        st = StoreStats(self.backend, self.url)
        parents: set[bytes] = set()
        keys: list[bytes] = []
        for b in self.blocks():
            keys.append(b.key)
            parents.add(b.parent)
            st.blocks += 1
            st.live_bytes += b.size
            st.per_class[b.ttl_class] = st.per_class.get(b.ttl_class, 0) + 1
            st.per_namespace[b.namespace] = st.per_namespace.get(b.namespace, 0) + 1
            st.oldest_created = b.created if st.oldest_created is None else min(st.oldest_created, b.created)
            if b.expiry is not None:
                st.next_expiry = b.expiry if st.next_expiry is None else min(st.next_expiry, b.expiry)
        st.chains = sum(1 for k in keys if k not in parents)
        if self.files is not None:
            fst = self.files.stats()
            st.disk_bytes, st.segments = fst.disk_bytes, fst.segments
            st.location += f" + {fst.location}"
        else:
            with contextlib.suppress(*FAULTS):
                st.disk_bytes = int(self.r.info("memory").get("used_memory", 0))
        st.counters = self.counters.as_dict()
        return st

    def verify(self, remove: bool = True) -> VerifyResult:
        if self.files is not None:  # the bytes are on files: check them, and unpublish what was removed
            before = {b.key for b in self.files.blocks()}
            res = self.files.verify(remove)
            lost = list(before - {b.key for b in self.files.blocks()})
            if remove and lost:
                with contextlib.suppress(*FAULTS):
                    self.r.delete(*[self._k(k) for k in lost])
            return res
        checked = bad = removed = nbytes = 0
        try:
            return self._verify(remove)
        except FAULTS as e:
            log.warning("verify of %s stopped: %s", self.url, e)
            return VerifyResult(checked, bad, removed, nbytes)

    def _verify(self, remove: bool) -> VerifyResult:
        checked = bad = removed = nbytes = 0
        for names in self._scan_names(64):
            pipe = self.r.pipeline(transaction=False)
            for name in names:
                pipe.hmget(name, "m", "d")
            for name, (m, d) in zip(names, pipe.execute()):
                if m is None and d is None:
                    continue  # expired between SCAN and HMGET
                checked += 1
                meta = decode_meta(m) if m is not None else None
                if meta is None or d is None or len(d) != meta[2] or xxhash.xxh3_64_intdigest(d) != meta[3]:
                    bad += 1
                    if remove:
                        removed += int(self.r.delete(name))
                else:
                    nbytes += len(d)
        return VerifyResult(checked, bad, removed, nbytes)

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
        with contextlib.suppress(*FAULTS):
            self.r.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
