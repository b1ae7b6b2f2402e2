"""The block store on Redis — one server or a Redis Cluster: the shared index of the cluster mode,
and the block bytes too for small deployments.

One Redis hash per block (named as `redis_keys` says: `{prefix}b:<16-byte key>` on one server)
with fields `m` (metadata, a packed struct — never pickle) and `d` (the bytes). Expiry is Redis's
own: the blocks of one put (or one hit) at chain positions p expire at the same instant minus p
milliseconds, so along a chain every tail expires before its head and a reader never sees a block
whose parent has expired (tails first, by construction). A chain extended by a later put can leave
a tail that outlives its head; it cannot be matched (CHECK walks from the head) and expires on its own.

CHECK is one Lua script per hash slot among the keys, batched per node: on one server one
script, one round trip; on a Redis Cluster (`redis+cluster://` URL) one round trip per master
touched, all masters at once (kvledger.util.redis_fanout). A script walks its keys in chain order,
refreshes each present block's expiry (`PEXPIREAT … GT`, never shortening it) and stops at its
first absent one; the answer is the chain position of the first absent key over all scripts. The
expiry instant is one for the whole CHECK: this server's `TIME` on one server, this client's clock
on a cluster (the masters' clocks would not order a chain split over them). No block byte touched.

Cluster mode (`files=` a FileStore on a shared mount: 3FS, CephFS, NFS): Redis holds only the
metadata and answers CHECK for every entrypoint; the bytes go to segment files that every
engine reads. Bytes are written before their metadata is published, and a file block lives
until GC finds that Redis no longer knows its key (expired or deleted).

Every call has a socket timeout; any Redis or socket error is logged and counted and turns
into a miss (`match` → the blocks before the first key of a failed node, 0 on one server;
`get_into` → -1; `put` → failed), never an exception.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import xxhash
from redis.crc import key_slot

from kvledger.store import redis_upkeep
from kvledger.store.backend import (
    BlockInfo,
    BlockStore,
    Buffer,
    ChainWrite,
    MISS,
    Counters,
    GcResult,
    PutResult,
    StoreStats,
    UNREADABLE,
    VerifyResult,
)
from kvledger.store.redis_keys import Placement
from kvledger.store.redis_meta import EXISTS, MATCH, PUT, decode_meta, encode_meta
from kvledger.util.redis_fanout import FAULTS, Call, RedisNodes, command, script_call

log = logging.getLogger("kvledger.store")

PUT_CHUNK_BYTES = 16 << 20           # bytes of one batched put/get round trip
FILE_TTL_S = 100 * 365 * 86_400.0  # bytes on files in the cluster mode live until Redis forgets their block
VOLUME_FILE = "volume.id"          # in the shared store folder: the id of the volume, as Redis records it
GC_GRACE_S = 60.0                  # cluster-mode GC spares file blocks younger than this (published any moment)


class RedisStore:
    """Blocks and their metadata on the Redis server or Redis Cluster at `url` (see the module docstring)."""

    backend = "redis"

    def __init__(self, url: str, *, prefix: str = "kvl:", timeout_s: float = 2.0, check: bool = False,
                 files: BlockStore | None = None) -> None:
        self.url = url
        self.files = files
        self.prefix = prefix.encode()
        self.bprefix = self.prefix + b"b:"
        self.counters = Counters()
        self.nodes = RedisNodes(url, timeout_s)
        self.place = Placement(self.bprefix, self.nodes.cluster)
        self._match = self.nodes.script(MATCH)
        self._exists = self.nodes.script(EXISTS)
        self._put = self.nodes.script(PUT)
        if check:  # raises: for the CLI, which reports an unreachable server (every master down) as bad input
            self._ping_any()
        # cluster mode: the files must be the volume this Redis's index describes (`claim_volume`); until that
        # is known, a block absent from them proves nothing and is never unpublished
        self.volume_id = ""   # the id of `files`' volume (`_claim_volume`)
        self.volume_verified = files is not None and self._claim_volume(files.root)

    def _claim_volume(self, root: Path) -> bool:
        """Whether `root` holds the volume Redis records (`VOLUME_FILE`, whose id Redis keeps under
        <prefix>volume). The first store to open a fresh pair writes both. ValueError when the folder is not
        that volume: an empty mount point, or another volume (its reads would unpublish blocks other
        machines can read). False when Redis cannot be asked now (nothing is unpublished then)."""
        local = self.volume_id = claim_volume_file(root)
        name = self.prefix + b"volume"
        slot = key_slot(name) if self.nodes.cluster else 0
        reply = self.nodes.run([Call(slot, command("SET", name, local, "NX", "GET"))])[0]
        if isinstance(reply, BaseException):
            log.warning("cannot check the volume of %s against %s: %s", root, self.url, reply)
            return False
        if reply is not None and reply.decode() != local:
            raise ValueError(f"{root} is not the volume the index at {self.url} describes ({VOLUME_FILE} says "
                             f"{local}, Redis {reply.decode()}): is the shared filesystem mounted there?")
        return True

    def _ping_any(self) -> None:
        """PING every master; raise a fault when none answers (a dead master of a cluster is logged)."""
        masters = self.nodes.masters()
        faults = []
        for node in masters:
            try:
                node.ping()
            except FAULTS as e:
                faults.append(e)
        if len(faults) == len(masters):
            raise faults[0]
        if not self.nodes.cluster and str(masters[0].info("cluster").get("cluster_enabled", 0)) == "1":
            raise ValueError("that server is a node of a Redis Cluster: give a redis+cluster://HOST:PORT URL")
        if faults:
            log.warning("%d of %d masters of %s do not answer: %s", len(faults), len(masters), self.url, faults[0])

    def _k(self, key: bytes) -> bytes:
        return self.place.name(key)

    # --- CHECK -----------------------------------------------------------------

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        if not keys:
            return 0
        ttl_ms = int(ttl_s * 1000)
        groups = self.place.groups(keys)
        if self.nodes.cluster:  # one instant for every master (their clocks would not order a chain)
            ttl, at = b"%d" % ttl_ms, b"%d" % (int(time.time() * 1000) + ttl_ms)
            calls = [Call(slot, script_call(self._match, self.place.names_of(keys, head, idx), ttl, at,
                                            array("I", idx).tobytes(), head=head)) for slot, head, idx in groups]
        else:
            calls = [Call(0, script_call(self._match, keys, ttl_ms, "", "", head=self.bprefix))]
        n, fault = len(keys), None
        for (_, _, idx), reply in zip(groups, self.nodes.run(calls)):
            if isinstance(reply, BaseException):
                fault, n = reply, min(n, idx[0])
            elif int(reply) < len(idx):
                n = min(n, idx[int(reply)])
        if fault is not None:
            log.warning("CHECK on %s failed (answering %d): %s", self.url, n, fault)
            self.counters.match_failures += 1
        return n

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return self._exists_or_raise(keys)
        except FAULTS as e:
            log.warning("exists on %s failed: %s", self.url, e)
            self.counters.exists_failures += 1
            return [False] * len(keys)

    def _exists_or_raise(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key; raises the first Redis fault (GC must not read a fault as "absent")."""
        if not keys:
            return []
        groups = self.place.groups(keys)
        calls = [Call(slot, script_call(self._exists, self.place.names_of(keys, head, idx), head=head))
                 for slot, head, idx in groups]
        out = [False] * len(keys)
        for (_, _, idx), bits in zip(groups, self.nodes.run(calls)):
            if isinstance(bits, BaseException):
                raise bits
            for i, c in zip(idx, bits):
                out[i] = c == ord("1")
        return out

    # --- write -----------------------------------------------------------------

    def put(self, write: ChainWrite) -> PutResult:
        now = time.time()  # the TTL runs from the call (a first call on a cluster learns the slot map first)
        n = len(write.keys)
        present = self.exists(write.keys)
        sel = [i for i in range(n) if not present[i]]
        skipped = n - len(sel)
        if self.files is not None and sel:
            on_files = self.files.put(ChainWrite(write.keys, write.blocks, write.start_pos, write.parent,
                                                 write.namespace, write.ttl_class, FILE_TTL_S))
            if on_files.failed:
                self.counters.put_failures += 1
                return PutResult(0, skipped, len(sel))
        expire_at_ms = int((now + write.ttl_s) * 1000)  # one clock for the whole put: the skew orders it exactly
        written = raced = 0  # raced: written by another writer between our exists and our put
        for chunk in self._chunks(sel, write.blocks):
            replies = self.nodes.run([self._put_call(write, i, now, expire_at_ms) for i in chunk])
            written += sum(1 for r in replies if r == 1)
            raced += sum(1 for r in replies if r == 0)
            fault = next((r for r in replies if isinstance(r, BaseException)), None)
            if fault is not None:  # stop here: a hung server would cost a timeout per chunk
                log.warning("put of %d blocks to %s failed: %s", len(sel), self.url, fault)
                self.counters.put_failures += 1
                self.counters.blocks_written += written
                return PutResult(written, skipped + raced, len(sel) - written - raced)
        self.counters.blocks_written += written
        self.counters.blocks_skipped += skipped + raced
        self.counters.bytes_written += sum(memoryview(write.blocks[i]).nbytes for i in sel)
        return PutResult(written, skipped + raced, 0)

    @staticmethod
    def _chunks(sel: list[int], blocks: Sequence[Buffer]) -> Iterator[list[int]]:
        """`sel` cut into runs of about PUT_CHUNK_BYTES of block bytes (one batch each)."""
        chunk: list[int] = []
        pending = 0
        for i in sel:
            chunk.append(i)
            pending += memoryview(blocks[i]).nbytes
            if pending >= PUT_CHUNK_BYTES:
                yield chunk
                chunk, pending = [], 0
        if chunk:
            yield chunk

    def _put_call(self, write: ChainWrite, i: int, now: float, expire_at_ms: int) -> Call:
        v = memoryview(write.blocks[i]).cast("B")
        parent = write.keys[i - 1] if i > 0 else write.parent
        pos = write.start_pos + i
        meta = encode_meta(parent, pos, v.nbytes, xxhash.xxh3_64_intdigest(v), now, write.ttl_s,
                           write.namespace, write.ttl_class)
        data = b"" if self.files is not None else v
        key = write.keys[i]
        return Call(self.place.slot(key), command("EVALSHA", self._put, 1, self._k(key), meta, data,
                                                  expire_at_ms - pos))

    # --- read ------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Buffer]) -> list[int]:
        if len(keys) != len(bufs):
            raise ValueError(f"one buffer per key: {len(keys)} keys, {len(bufs)} buffers")
        if self.files is not None:
            return self._get_from_files(keys, bufs)
        out = [-1] * len(keys)
        for chunk in self._chunks(list(range(len(keys))), bufs):
            calls = [Call(self.place.slot(keys[i]), command("HMGET", self._k(keys[i]), "m", "d")) for i in chunk]
            replies = self.nodes.run(calls)
            fault = next((r for r in replies if isinstance(r, BaseException)), None)
            for i, reply in zip(chunk, replies):
                if isinstance(reply, BaseException):
                    self.counters.misses_absent += 1
                else:
                    out[i] = self._check_copy(keys[i], reply[0], reply[1], bufs[i])
            if fault is not None:  # stop here (a hung server would cost a timeout per chunk): the rest is a miss
                log.warning("get from %s failed: %s", self.url, fault)
                self.counters.misses_absent += len(keys) - 1 - chunk[-1]
                return out
        return out

    def _get_from_files(self, keys: Sequence[bytes], bufs: Sequence[Buffer]) -> list[int]:
        """Cluster mode: Redis decides which blocks are live (the files keep bytes Redis may have expired),
        the files give the bytes. One EXISTS round trip (per node), then the reads."""
        out = [-1] * len(keys)
        live = [i for i, alive in enumerate(self.exists(keys)) if alive]
        self.counters.misses_absent += len(keys) - len(live)
        if not live:
            return out
        for i, size in zip(live, self.files.get_into([keys[i] for i in live], [bufs[i] for i in live])):
            out[i] = size
        again = [i for i in live if out[i] == MISS]   # UNREADABLE (a local read error) proves nothing
        if again:  # another machine's segment may be newer than our listing: look again
            self.files.refresh(force=True)
            for i, size in zip(again, self.files.get_into([keys[i] for i in again], [bufs[i] for i in again])):
                out[i] = size
        self.counters.misses_unreadable += sum(out[i] == UNREADABLE for i in live)   # the files counted them too
        lost = [keys[i] for i in again if out[i] == MISS]
        if lost and self.volume_verified:  # absent after a fresh look, or damaged: unpublish, so that the next
            self._unpublish(lost)          # put writes them again (rule 8: only proven loss removes a block)
        return out

    def _check_copy(self, key: bytes, m: bytes | None, d: bytes | None, buf: Buffer) -> int:
        if m is None or d is None:
            self.counters.misses_absent += 1
            return -1
        meta = decode_meta(m)
        if meta is None or len(d) != meta[2] or xxhash.xxh3_64_intdigest(d) != meta[3]:
            self.counters.misses_corrupt += 1
            log.warning("block %s on %s fails its checksum: deleted", key.hex(), self.url)
            self._unpublish([key])
            return -1
        v = memoryview(buf).cast("B")
        if v.nbytes < len(d):
            raise ValueError(f"a buffer holds {v.nbytes} bytes, the block {len(d)}")
        v[:len(d)] = d
        self.counters.blocks_read += 1
        self.counters.bytes_read += len(d)
        return len(d)

    # --- removal and operator views ----------------------------------------------

    def _unpublish(self, keys: Sequence[bytes]) -> int:
        """DEL the Redis keys of `keys` (one DEL per group of one slot); how many existed (a fault is logged)."""
        groups = self.place.groups(keys)
        calls = [Call(slot, command("DEL", *[self._k(keys[i]) for i in idx])) for slot, _, idx in groups]
        replies = self.nodes.run(calls)
        fault = next((r for r in replies if isinstance(r, BaseException)), None)
        if fault is not None:
            log.warning("delete on %s failed: %s", self.url, fault)
        return sum(int(r) for r in replies if not isinstance(r, BaseException))

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        if self.files is not None:
            self.files.delete(keys)
        return self._unpublish(keys)

    def blocks(self) -> Iterator[BlockInfo]:
        return redis_upkeep.blocks(self)

    def refresh(self, force: bool = False) -> None:
        """Every reader shares Redis: nothing to learn (the files, in the cluster mode, are refreshed on a miss)."""

    def gc(self, batch: int = 1000) -> GcResult:
        """Expiry is Redis's own (tails first by construction); this removes blocks whose metadata is
        unreadable and, in the cluster mode, file blocks whose key Redis no longer holds (tails first)."""
        removed = batches = freed = 0
        try:
            removed, batches = redis_upkeep.remove_unreadable(self, batch)
            if self.files is not None:
                removed_f, freed, b = redis_upkeep.gc_files(self, batch, GC_GRACE_S)
                removed += removed_f
                batches += b
        except FAULTS as e:
            log.warning("gc on %s stopped: %s", self.url, e)
        return GcResult(removed, 0, freed, batches)

    def stats(self) -> StoreStats:
        """Figures of the blocks Redis holds (those counted before a fault, if the server goes away mid-scan)."""
        return redis_upkeep.stats(self)

    def verify(self, remove: bool = True) -> VerifyResult:
        if self.files is not None:  # the bytes are on files: check them, and unpublish what was removed
            before = {b.key for b in self.files.blocks()}
            res = self.files.verify(remove)
            lost = list(before - {b.key for b in self.files.blocks()})
            if remove and lost:
                self._unpublish(lost)
            return res
        try:
            return redis_upkeep.verify(self, remove)
        except FAULTS as e:
            log.warning("verify of %s stopped: %s", self.url, e)
            return VerifyResult(0, 0, 0, 0)

    def probe(self) -> str | None:
        """Cluster mode: the shared folder answers and is still the volume it was at open (an unmounted path
        shows the empty mount point, which holds no `VOLUME_FILE` or another one)."""
        if self.files is None:
            return None
        if (why := self.files.probe()) is not None:
            return why
        try:
            volume = (self.files.root / VOLUME_FILE).read_text().strip()
        except OSError as e:
            return f"{self.files.root / VOLUME_FILE} does not read ({e.strerror})"
        if volume != self.volume_id:
            return f"{self.files.root} is no longer the volume opened ({VOLUME_FILE} says {volume or 'nothing'})"
        return None

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
        self.nodes.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def claim_volume_file(root: Path) -> str:
    """The volume id of the store folder `root` (`VOLUME_FILE`), created when the folder holds none (O_EXCL:
    concurrent first opens agree on one). An empty mount point gets a new id, which Redis then refuses."""
    path = Path(root) / VOLUME_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path.read_text().strip()
