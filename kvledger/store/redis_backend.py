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
refreshes each present block's expiry (never shortening it; only one that lags by more than the
refresh grain, redis_meta.py) and stops at its first absent one; the answer is the chain position of
the first absent key over all scripts. The expiry instant is one for the whole CHECK: this server's
`TIME` on one server, this client's clock on a cluster (the masters' clocks would not order a chain
split over them). No block byte touched. `match_explained` asks the same scripts to read, at their
first absent key, its tombstone (redis_meta.py: expired or evicted, and when): the one of the script
that holds the chain's first absent key is the answer. Nothing more runs when every key is present.

Cluster mode (`files=` SharedFiles on a shared mount: 3FS, CephFS, NFS): Redis holds only the
metadata and answers CHECK for every entrypoint; the bytes go to segment files that every engine
reads, and each block's hash records where (field `l`: segment file and offset). A read is one
round trip (per node) for the metadata of all its keys, then one `preadv` per run of blocks back
to back in one file: no listing of the mount. Bytes are written before their metadata is
published, and a file block lives until GC finds that Redis no longer knows its key.

Capacity and quotas (redis_quota.py): every block's bytes count in its bucket's total (tenant namespace and
TTL class), kept by the same scripts that add, refresh and remove it; with `capacity_bytes`, a put that leaves
the store past it evicts least recently refreshed blocks, guarantees first kept (quota.py). The capacity
bounds the blocks' bytes (in Redis, or on the mount in the cluster mode), not the server's memory.

Every call has a socket timeout; any Redis or socket error is logged and counted and turns
into a miss (`match` → the blocks before the first key of a failed node, 0 on one server;
`get_into` → -1; `put` → failed), never an exception.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash
from redis.crc import key_slot

from kvledger.core.attribution import MissCause
from kvledger.store import redis_forget, redis_upkeep
from kvledger.store.backend import (
    BlockInfo,
    Buffer,
    ChainWrite,
    Dest,
    MISS,
    Counters,
    GcResult,
    Gone,
    Match,
    PutResult,
    StoreStats,
    UNREADABLE,
    VerifyResult,
    stored_name,
)
from kvledger.store.forget import Forgotten, tenant_tag
from kvledger.store.quota import Quotas, bucket_and_id
from kvledger.store.redis_keys import Placement
from kvledger.store.redis_quota import RedisQuota, quota_field
from kvledger.store.segment_files import PartDone, bytes_view, dest_bytes, dest_parts
from kvledger.store.shared_files import VOLUME_FILE, Location, SharedFiles
from kvledger.store.redis_meta import (BURY, CLAIM_VOLUME, EVICT, EXISTS, MATCH, PUT, REFRESH_GRAIN, TOMB_GRACE_S,
                                       decode_meta, encode_meta)
from kvledger.util.redis_client import shown_url
from kvledger.util.redis_fanout import FAULTS, Call, RedisNodes, command, script_call

log = logging.getLogger("kvledger.store")

PUT_CHUNK_BYTES = 16 << 20  # bytes of one batched put/get round trip
GC_GRACE_S = 60.0           # cluster-mode GC spares file blocks younger than this (published any moment)
__all__ = ["RedisStore", "VOLUME_FILE", "GC_GRACE_S"]


_CAUSES = {b"expired": MissCause.EXPIRED, b"evicted": MissCause.EVICTED}


def _why(reply: bytes) -> tuple[int, Gone]:
    """MATCH's explained answer 'COUNT CAUSE UNIX_MS' → (count, its tombstone)."""
    first, cause, ms = reply.split()
    return int(first), Gone(_CAUSES[cause], int(ms) / 1000)


class RedisStore:
    """Blocks and their metadata on the Redis server or Redis Cluster at `url` (see the module docstring).
    `tomb_grace_s`: how long a tombstone outlives its block (redis_meta.py; one value for every client of a
    store: the default but in tests). `capacity_bytes`: live block bytes past which a put evicts; `quotas`: the
    guarantees eviction keeps, recorded on the server for every client and `kvledger store stats` (None: the
    recorded ones). ValueError for a capacity on a Redis Cluster under a prefix whose names share no slot."""

    backend = "redis"

    def __init__(self, url: str, *, prefix: str = "kvl:", timeout_s: float = 2.0, check: bool = False,
                 files: SharedFiles | None = None, tomb_grace_s: float = TOMB_GRACE_S,
                 capacity_bytes: int | None = None, quotas: Quotas | None = None) -> None:
        assert capacity_bytes is None or capacity_bytes > 0
        self.url = url                  # reopens the store (another process): may carry a password
        self.shown = shown_url(url)     # what logs, errors and stats print
        self.files = files
        self.prefix = prefix.encode()
        self.bprefix = self.prefix + b"b:"
        self.counters = Counters()
        self.nodes = RedisNodes(url, timeout_s)
        self.place = Placement(self.bprefix, self.nodes.cluster, self.prefix + b"t:", self.prefix + b"u:",
                               self.prefix + b"z:")
        if capacity_bytes is not None and not self.place.accounted:
            raise ValueError(f"prefix {prefix!r} leaves a block's totals in no common hash slot of the cluster: "
                             "no capacity can be kept under it")
        self.grace_ms = int(tomb_grace_s * 1000)
        self._tomb_args = (self.place.tprefix, len(self.bprefix), self.grace_ms)   # MATCH's and BURY's
        self._bury_args = (*self._tomb_args, self.place.uprefix, self.place.zprefix)
        self._match = self.nodes.script(MATCH)
        self._exists = self.nodes.script(EXISTS)
        self._put = self.nodes.script(PUT)
        self._bury = self.nodes.script(BURY)
        self._claim = self.nodes.script(CLAIM_VOLUME)
        if check:  # raises: for the CLI, which reports an unreachable server (every master down) as bad input
            self._ping_any()
        self.capacity_bytes = capacity_bytes
        self.quota = RedisQuota(self.nodes, self.place, capacity_bytes, self._settle_quotas(quotas), self.counters,
                                self.nodes.script(EVICT), self._bury_args, self.shown)
        # cluster mode: the files must be the volume this Redis's index describes (`claim_volume`); until that
        # is known, a block absent from them proves nothing and is never unpublished
        self.volume_verified = files is not None and self._claim_volume(files)

    def _claim_volume(self, files: SharedFiles) -> bool:
        """Whether `root` holds the volume Redis records (`VOLUME_FILE`, whose id Redis keeps under
        <prefix>volume). The first store to open a fresh pair writes both. ValueError when the folder is not
        that volume: an empty mount point, or another volume (its reads would unpublish blocks other
        machines can read). False when Redis cannot be asked now (nothing is unpublished then)."""
        root, local = files.root, files.claim_volume()
        name = self.prefix + b"volume"
        slot = key_slot(name) if self.nodes.cluster else 0
        reply = self.nodes.run([Call(slot, script_call(self._claim, [name], local))])[0]
        if isinstance(reply, BaseException):
            log.warning("cannot check the volume of %s against %s: %s", root, self.shown, reply)
            return False
        if reply.decode() != local:
            raise ValueError(f"{root} is not the volume the index at {self.shown} describes ({VOLUME_FILE} says "
                             f"{local}, Redis {reply.decode()}): is the shared filesystem mounted there?")
        return True

    def _settle_quotas(self, quotas: Quotas | None) -> Quotas:
        """`quotas`, recorded under `{prefix}quotas` (JSON) for every client; None: the record (none if absent or
        unreachable now)."""
        name = self.prefix + b"quotas"
        call = command("GET", name) if quotas is None else command("SET", name, quotas.to_json())
        reply = self.nodes.run([Call(self.nodes.slot(name), call)])[0]
        if isinstance(reply, BaseException):
            log.warning("cannot %s the quotas of %s: %s", "read" if quotas is None else "record", self.shown, reply)
            return quotas or Quotas()
        if quotas is not None:
            return quotas
        return Quotas.from_json(reply) if reply is not None else Quotas()

    @property
    def quotas(self) -> Quotas:
        return self.quota.quotas

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
            log.warning("%d of %d masters of %s do not answer: %s", len(faults), len(masters), self.shown, faults[0])

    def _k(self, key: bytes) -> bytes:
        return self.place.name(key)

    # --- CHECK -----------------------------------------------------------------

    def match(self, keys: Sequence[bytes], ttl_s: float) -> int:
        return self._check(keys, ttl_s, False).blocks

    def match_explained(self, keys: Sequence[bytes], ttl_s: float) -> Match:
        return self._check(keys, ttl_s, True)

    def _check(self, keys: Sequence[bytes], ttl_s: float, explain: bool) -> Match:
        """The MATCH scripts of `keys` (one per slot, one round trip per node); `explain`: with the tombstone of
        the first absent key. A failed node answers the keys before its first one, with no tombstone."""
        if not keys:
            return Match(0)
        ttl_ms = int(ttl_s * 1000)
        tail = (ttl_ms // REFRESH_GRAIN, *self._tomb_args, b"1" if explain else b"", self.place.zprefix)
        groups = self.place.groups(keys)
        if self.nodes.cluster:  # one instant for every master (their clocks would not order a chain)
            ttl, at = b"%d" % ttl_ms, b"%d" % (int(time.time() * 1000) + ttl_ms)
            calls = [Call(slot, script_call(self._match, self.place.names_of(keys, head, idx), ttl, at,
                                            array("I", idx).tobytes(), *tail, head=head))
                     for slot, head, idx in groups]
        else:
            calls = [Call(0, script_call(self._match, keys, ttl_ms, "", "", *tail, head=self.bprefix))]
        n, gone, fault = len(keys), None, None
        for (_, _, idx), reply in zip(groups, self.nodes.run(calls)):
            if isinstance(reply, BaseException):
                fault = reply
                if idx[0] < n:
                    n, gone = idx[0], None
                continue
            first, why = (reply, None) if isinstance(reply, int) else _why(reply)
            if first < len(idx) and idx[first] < n:
                n, gone = idx[first], why
        if fault is not None:
            log.warning("CHECK on %s failed (answering %d): %s", self.shown, n, fault)
            self.counters.match_failures += 1
        return Match(n, gone)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            return self._exists_or_raise(keys)
        except FAULTS as e:
            log.warning("exists on %s failed: %s", self.shown, e)
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
        incoming = sum(memoryview(write.blocks[i]).nbytes for i in sel)
        if self.capacity_bytes is not None and incoming > self.capacity_bytes:
            log.warning("put of %d bytes exceeds the store's capacity %d", incoming, self.capacity_bytes)
            self.counters.put_failures += 1
            return PutResult(0, skipped, len(sel))
        where: dict[int, bytes] = {}   # cluster mode: each block's location, once its file is whole
        if self.files is not None and sel:
            try:
                located = self.files.write(write, sel, [bytes_view(write.blocks[i]) for i in sel], now)
            except OSError as e:
                log.warning("put of %d blocks to %s failed: %s", len(sel), self.files.root, e)
                self.counters.put_failures += 1
                return PutResult(0, skipped, len(sel))
            where = {i: loc.pack() for i, loc in zip(sel, located)}
        expire_at_ms = int((now + write.ttl_s) * 1000)  # one clock for the whole put: the skew orders it exactly
        bid, bucket = bucket_and_id(stored_name(write.namespace), stored_name(write.ttl_class))
        account = (bid, bucket.pack(), int(now * 1000), tenant_tag(write.namespace))
        written = raced = refused = 0  # raced: written by another writer between our exists and our put
        for chunk in self._chunks(sel, write.blocks):
            replies = self.nodes.run([self._put_call(write, i, now, expire_at_ms, where.get(i), account)
                                      for i in chunk])
            written += sum(1 for r in replies if r == 1)
            raced += sum(1 for r in replies if r == 0)
            refused += sum(1 for r in replies if r == 2)   # its tenant is held after a forget (store/forget.py)
            fault = next((r for r in replies if isinstance(r, BaseException)), None)
            if fault is not None:  # stop here: a hung server would cost a timeout per chunk
                log.warning("put of %d blocks to %s failed: %s", len(sel), self.shown, fault)
                self.counters.put_failures += 1
                self.counters.blocks_written += written
                self.counters.blocks_refused += refused
                return PutResult(written, skipped + raced, len(sel) - written - raced)
        self.counters.blocks_written += written
        self.counters.blocks_skipped += skipped + raced
        self.counters.blocks_refused += refused
        self.counters.bytes_written += incoming
        if written:
            self.quota.make_room()
        return PutResult(written, skipped + raced, refused)

    @staticmethod
    def _chunks(sel: list[int], blocks: Sequence[Buffer]) -> Iterator[list[int]]:
        """`sel` cut into runs of about PUT_CHUNK_BYTES of block bytes (one batch each)."""
        chunk: list[int] = []
        pending = 0
        for i in sel:
            chunk.append(i)
            pending += dest_bytes(blocks[i])
            if pending >= PUT_CHUNK_BYTES:
                yield chunk
                chunk, pending = [], 0
        if chunk:
            yield chunk

    def _put_call(self, write: ChainWrite, i: int, now: float, expire_at_ms: int, where: bytes | None,
                  account: tuple[bytes, bytes, int, bytes]) -> Call:
        """The PUT script of block i: its bytes in field `d`, or its location `where` in field `l`; `account`: its
        bucket id, the bucket's packed names and the put's instant in ms (redis_quota.py), and its tenant's tag:
        refused while the tenant's hold lives in its slot, and carried by its tombstone (store/forget.py)."""
        v = memoryview(write.blocks[i]).cast("B")
        parent = write.keys[i - 1] if i > 0 else write.parent
        pos = write.start_pos + i
        meta = encode_meta(parent, pos, v.nbytes, xxhash.xxh3_64_intdigest(v), now, write.ttl_s,
                           write.namespace, write.ttl_class)
        field, value = ("d", v) if where is None else ("l", where)
        key = write.keys[i]
        names = [self._k(key)]
        if (tomb := self.place.tomb_name(key)) is not None:
            names.append(tomb)
        bid, bucket_names, now_ms, tag = account
        return Call(self.place.slot(key), command("EVALSHA", self._put, len(names), *names, meta, field, value,
                                                  expire_at_ms - pos, self.grace_ms, self.place.uprefix,
                                                  self.place.zprefix, len(self.bprefix),
                                                  quota_field(bid, v.nbytes), bucket_names, now_ms,
                                                  self.place.hold_name(key, tag) or b"", tag.hex()))

    # --- read ------------------------------------------------------------------

    def get_into(self, keys: Sequence[bytes], bufs: Sequence[Dest], *, on_part: PartDone | None = None) -> list[int]:
        """`BlockStore.get_into`; bytes inline in Redis arrive whole, so `on_part` is for the cluster's files only."""
        if len(keys) != len(bufs):
            raise ValueError(f"one buffer per key: {len(keys)} keys, {len(bufs)} buffers")
        if self.files is not None:
            return self._get_from_files(keys, bufs, on_part)
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
                log.warning("get from %s failed: %s", self.shown, fault)
                self.counters.misses_absent += len(keys) - 1 - chunk[-1]
                return out
        return out

    def _get_from_files(self, keys: Sequence[bytes], bufs: Sequence[Dest], on_part: PartDone | None) -> list[int]:
        """Cluster mode: one round trip (per node) for every key's metadata and location, then the reads.
        Proven damage unpublishes the block (so that the next put writes it again); a local read error does
        not (rule 8), nor does anything while the folder is not known to be Redis's volume."""
        out = [MISS] * len(keys)
        replies = self.nodes.run([Call(self.place.slot(k), command("HMGET", self._k(k), "m", "l")) for k in keys])
        located: list[tuple[int, Location]] = []
        bad: list[bytes] = []
        for i, reply in enumerate(replies):
            if isinstance(reply, BaseException) or reply[0] is None:
                self.counters.misses_absent += 1
            elif (loc := self._location(reply[0], reply[1])) is None:
                self.counters.misses_corrupt += 1
                bad.append(keys[i])
            else:
                located.append((i, loc))
        fault = next((r for r in replies if isinstance(r, BaseException)), None)
        if fault is not None:
            log.warning("get from %s failed: %s", self.shown, fault)
        for (i, _), got in zip(located, self.files.read(located, bufs, on_part)):
            if isinstance(got, int):
                out[i] = got
                self.counters.blocks_read += 1
                self.counters.bytes_read += got
                continue
            setattr(self.counters, f"misses_{got}", getattr(self.counters, f"misses_{got}") + 1)
            if got == "unreadable":
                out[i] = UNREADABLE
            else:
                bad.append(keys[i])
        if bad and self.volume_verified:
            self._unpublish(bad)
        return out

    @staticmethod
    def _location(m: bytes, loc: bytes | None) -> Location | None:
        """Where the block whose fields are `m`, `l` lies (None when either does not parse)."""
        meta = decode_meta(m)
        return None if meta is None or loc is None else Location.unpack(loc, meta[2], meta[3])

    def _check_copy(self, key: bytes, m: bytes | None, d: bytes | None, buf: Dest) -> int:
        if m is None or d is None:
            self.counters.misses_absent += 1
            return -1
        meta = decode_meta(m)
        if meta is None or len(d) != meta[2] or xxhash.xxh3_64_intdigest(d) != meta[3]:
            self.counters.misses_corrupt += 1
            log.warning("block %s on %s fails its checksum: deleted", key.hex(), self.shown)
            self._unpublish([key])
            return -1
        at, data = 0, memoryview(d)
        for part in dest_parts(buf, len(d)):
            part[:] = data[at:at + part.nbytes]
            at += part.nbytes
        self.counters.blocks_read += 1
        self.counters.bytes_read += len(d)
        return len(d)

    # --- removal and operator views ----------------------------------------------

    def _unpublish(self, keys: Sequence[bytes]) -> int:
        """Delete the blocks `keys`, each leaving an evicted tombstone (BURY: one script per group of one slot);
        how many existed (a fault is logged)."""
        return self.bury([(slot, [self._k(keys[i]) for i in idx]) for slot, _, idx in self.place.groups(keys)])

    def bury(self, batches: Sequence[tuple[int, list[bytes]]]) -> int:
        """Delete blocks by Redis name, each leaving an evicted tombstone: one BURY script per (hash slot, names of
        blocks in that slot), one round trip per node; how many existed (a fault is logged, never raised)."""
        replies = self.nodes.run([Call(slot, script_call(self._bury, names, *self._bury_args))
                                  for slot, names in batches])
        fault = next((r for r in replies if isinstance(r, BaseException)), None)
        if fault is not None:
            log.warning("delete on %s failed: %s", self.shown, fault)
        return sum(int(r) for r in replies if not isinstance(r, BaseException))

    def delete(self, keys: Sequence[bytes]) -> int:
        """Unpublish `keys` (tombstones say evicted); in the cluster mode their bytes go at the next GC (no key
        names them)."""
        if not keys:
            return 0
        return self._unpublish(keys)

    def forget(self, tenant: str, hold_s: float) -> Forgotten:
        """`BlockStore.forget` (redis_forget.py)."""
        return redis_forget.forget(self, tenant, hold_s, self._bury_args)

    def blocks(self) -> Iterator[BlockInfo]:
        return redis_upkeep.blocks(self)

    def refresh(self, force: bool = False) -> None:
        """Every reader shares Redis: nothing to learn."""

    def gc(self, batch: int = 1000) -> GcResult:
        """Expiry is Redis's own (tails first by construction); this removes blocks whose metadata is
        unreadable, releases the totals of blocks Redis expired (redis_quota.py's sweep), evicts down to the
        capacity, and in the cluster mode removes file blocks whose key Redis no longer holds (tails first)."""
        removed = batches = freed = 0
        evicted = self.counters.gc_evicted
        try:
            if self.place.accounted:
                self.quota.sweep()
                self.quota.make_room()
            removed, batches = redis_upkeep.remove_unreadable(self, batch)
            if self.files is not None:
                removed_f, freed, b = self.files.collect(self._exists_or_raise, GC_GRACE_S, batch)
                removed += removed_f
                batches += b
        except FAULTS as e:
            log.warning("gc on %s stopped: %s", self.shown, e)
        return GcResult(removed, self.counters.gc_evicted - evicted, freed, batches)

    def stats(self) -> StoreStats:
        """Figures of the blocks Redis holds (those counted before a fault, if the server goes away mid-scan)."""
        return redis_upkeep.stats(self)

    def verify(self, remove: bool = True) -> VerifyResult:
        try:
            return redis_upkeep.verify(self, remove)
        except FAULTS as e:
            log.warning("verify of %s stopped: %s", self.shown, e)
            return VerifyResult(0, 0, 0, 0)

    def probe(self) -> str | None:
        """Cluster mode: the shared folder answers and is still the volume it was at open."""
        return None if self.files is None else self.files.probe()

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
        self.nodes.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

