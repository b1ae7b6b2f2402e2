"""The processes of `kvledger bench scale`, one role each: `python -m kvledger.bench.scale_roles ROLE JSON`.

Each role opens the store of one design and prints one JSON line of figures: "new", the LMDB store
as it is written; "old", the baseline: a folder of the previous layout (segment files without an
index, as the retired scan store wrote them), whose index the `rebuild` role builds from every
segment's metadata at open (what that design did at every open, and what the migration does once).
Blocks are `block_bytes` bytes (small, so the disk is not what is measured), `per_put` blocks per put;
synthetic chains have keys H(chain id, position) — the store never derives keys, it only stores them —
and the CHECK prompt has real chain keys (hashing included).

    build   grow the store to `blocks` blocks (chains of 8,192 blocks, the 1M-token prompt among them)
    rebuild "old": drop the index and open: open_s, rss_bytes of a rebuild from every segment
    probe   open_s, rss_bytes, check_ms_1m (median, keys given; hash_ms_1m apart), put_p99_ms (while a
            `writer` runs; fsync off, or on with put_p99_ms_fsync); each put's CPU (put_cpu_ms, median) burnt
            again in a loop right after it: put_floor_p99_ms
    fsync   the disk's floor: a small file written and fsynced
    writer  puts until the stop file appears
    stall   alternate a put and a CHECK until the stop file appears; the longest of each (ms)
    victims write `blocks` blocks with a 1-second TTL (for the GC run)
    gc      one gc(); gc_s, and the counts
    warm    read the index file once (the page cache then holds it, as a serving node's would);
            the share of its pages cached before and after
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.core import ModelSpec
from kvledger.core.spec import PUBLISHED_MODEL
from kvledger.store.backend import ChainWrite
from kvledger.store.index_pin import cached_share
from kvledger.store.ledger import BlockLedger
from kvledger.store.lmdb_index import INDEX_DIR, data_file

SPEC = ModelSpec.preset(PUBLISHED_MODEL)
CHAIN_BLOCKS = 8192            # a 1M-token prompt at 128 tokens per block
CHECK_TOKENS = CHAIN_BLOCKS * SPEC.block_size
NAMESPACE = "scale"
TTL_S = 30 * 86400.0


def open_store(design: str, root: str, fsync: bool = True) -> Any:
    """Either design's store (after the "old" one's rebuild, the LMDB store on the previous layout's files)."""
    from kvledger.store.open import StoreLocation, open_block_store

    return open_block_store(StoreLocation(root), fsync=fsync)


def synthetic_keys(chain_id: int, start: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{chain_id}:{p}".encode(), digest_size=16).digest() for p in range(start, start + n)]


def check_tokens() -> np.ndarray:
    return np.random.default_rng(12).integers(0, 100_000, CHECK_TOKENS, dtype=np.uint32)


def spin_ms(cpu_s: float) -> float:
    """Wall time (ms) of burning `cpu_s` seconds of this process's CPU in a loop: what work of that much CPU takes
    here with no lock, no I/O and no page fault to wait for, the scheduler's share of the cores alone."""
    t = time.perf_counter()
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass
    return (time.perf_counter() - t) * 1e3


def put_chain(store: Any, keys: list[bytes], start: int, parent: bytes, block: bytes, ttl_s: float = TTL_S) -> float:
    """One put of `keys` at chain positions start..; its latency in ms."""
    t = time.perf_counter()
    store.put(ChainWrite(keys, [block] * len(keys), start, parent, NAMESPACE, "agent", ttl_s))
    return (time.perf_counter() - t) * 1e3


def write_chain(store: Any, keys: list[bytes], per_put: int, block: bytes, ttl_s: float = TTL_S) -> None:
    for s in range(0, len(keys), per_put):
        put_chain(store, keys[s:s + per_put], s, keys[s - 1] if s else bytes(16), block, ttl_s)


def bulk_chain(store: Any, keys: list[bytes], per_put: int, block: bytes) -> None:
    """The new design's build: the same segments as `write_chain`, a chain's segments indexed in one transaction
    (building only: the measured puts go through `put`)."""

    now = time.time()
    written = []
    for s in range(0, len(keys), per_put):
        w = ChainWrite(keys[s:s + per_put], [block] * len(keys[s:s + per_put]), s, keys[s - 1] if s else bytes(16),
                       NAMESPACE, "agent", TTL_S)
        sel = list(range(len(w.keys)))
        written.append((w, *store.writer.write_segment(w, sel, [memoryview(block)] * len(sel), now)))
    with store.index.env.begin(write=True) as txn:
        for w, path, rows, size in written:
            store.writer.index_rows(txn, w, path, rows, size, now)


def previous_layout_chain(files: Any, keys: list[bytes], per_put: int, block: bytes) -> None:
    """The "old" design's build: the segments `write_chain` would write, in the previous layout (flat
    segments/*.kvs, no index: SharedFiles writes that layout)."""
    now = time.time()
    for s in range(0, len(keys), per_put):
        w = ChainWrite(keys[s:s + per_put], [block] * len(keys[s:s + per_put]), s, keys[s - 1] if s else bytes(16),
                       NAMESPACE, "agent", TTL_S)
        files.write(w, range(len(w.keys)), [memoryview(block)] * len(w.keys), now)


def role_build(a: dict) -> dict:
    if a["design"] == "old":
        from kvledger.store.shared_files import SharedFiles

        store = SharedFiles(a["root"], fsync=False)
        bulk = previous_layout_chain
    else:
        store, bulk = open_store(a["design"], a["root"], fsync=False), bulk_chain
    block = bytes(a["block_bytes"])
    t = time.perf_counter()
    from kvledger.core import extend_chain, root_key

    keys = extend_chain(root_key(SPEC, NAMESPACE), check_tokens(), SPEC.block_size)
    bulk(store, keys, a["per_put"], block)
    have = len(keys)
    chain_id = 0
    while have < a["blocks"]:
        n = min(CHAIN_BLOCKS, a["blocks"] - have)
        bulk(store, synthetic_keys(chain_id, 0, n), a["per_put"], block)
        have += n
        chain_id += 1
        if chain_id % 100 == 0:
            print(json.dumps({"progress": have, "s": time.perf_counter() - t}), file=sys.stderr, flush=True)
    store.close()
    return {"build_s": time.perf_counter() - t, "blocks": have}


def _rss(field: str = "VmRSS") -> int:
    """Resident bytes from /proc/self/status: VmRSS (all), RssAnon (the process's own), RssFile (mapped files:
    shared libraries and the pages of the index's map this process touched, all of them page cache)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def role_probe(a: dict) -> dict:
    """open_s, rss_bytes, CHECK of the 1M-token prompt (index only; hashing apart), puts timed."""
    from kvledger.core import extend_chain, root_key

    tokens = check_tokens()
    import kvledger.store.lmdb_store  # noqa: F401  (imports are not the open)

    t = time.perf_counter()
    store = open_store(a["design"], a["root"], fsync=a["fsync"])
    open_s = time.perf_counter() - t
    out: dict[str, Any] = {"open_s": open_s} if not a["fsync"] else {}
    if not a["fsync"]:
        hashes, checks, found = [], [], 0
        for _ in range(a["check_reps"]):
            t = time.perf_counter()
            keys = extend_chain(root_key(SPEC, NAMESPACE), tokens, SPEC.block_size)
            hashes.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            found = store.match(keys, TTL_S)
            checks.append((time.perf_counter() - t) * 1e3)
        out |= {"check_ms_1m": statistics.median(checks), "check_found_blocks": found,
                "hash_ms_1m": statistics.median(hashes)}
    block = bytes(a["block_bytes"])
    puts, cpus, floors = [], [], []
    for i in range(a["puts"]):
        cpu = time.process_time()
        puts.append(put_chain(store, synthetic_keys(10**9 + os.getpid() * 10**4 + i, 0, a["per_put"]), 0, bytes(16),
                              block))
        cpus.append(time.process_time() - cpu)
        floors.append(spin_ms(cpus[-1]))
    tag = "_fsync" if a["fsync"] else ""
    out |= {f"put_p99_ms{tag}": float(np.percentile(puts, 99)), f"put_p50_ms{tag}": statistics.median(puts),
            f"put_cpu_ms{tag}": statistics.median(cpus) * 1e3,
            f"put_floor_p99_ms{tag}": float(np.percentile(floors, 99)),
            f"put_floor_p50_ms{tag}": statistics.median(floors)}
    if not a["fsync"]:
        out |= {"rss_bytes": _rss(), "rss_anon_bytes": _rss("RssAnon"), "rss_file_bytes": _rss("RssFile")}
        out["store_blocks"] = _blocks(store)
        out["index_bytes"] = os.path.getsize(data_file(Path(a["root"])))
    store.close()
    return out


def _blocks(store: Any) -> int:
    with store.index.env.begin() as txn:   # the LMDB index keeps its totals: O(1)
        return store.index.total(txn, b"blocks")


def role_rebuild(a: dict) -> dict:
    """The baseline's open: the index dropped, then built again from every segment's metadata (the migration)."""
    import shutil

    import kvledger.store.lmdb_store  # noqa: F401  (imports are not the open)

    shutil.rmtree(os.path.join(a["root"], INDEX_DIR), ignore_errors=True)
    t = time.perf_counter()
    store = open_store(a["design"], a["root"], fsync=False)
    open_s = time.perf_counter() - t
    out = {"open_s": open_s, "rss_bytes": _rss(), "rss_anon_bytes": _rss("RssAnon"),
           "rss_file_bytes": _rss("RssFile"), "rebuilt_blocks": _blocks(store)}
    store.close()
    return out


def role_fsync(a: dict) -> dict:
    """The disk's own floor: p50/p99 of writing a small file and fsyncing it (no store)."""
    ts = []
    for i in range(a.get("n", 100)):
        path = os.path.join(a["root"], f".fsync-probe-{os.getpid()}-{i}")
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, bytes(4096 + a["per_put"] * a["block_bytes"]))
        os.fsync(fd)
        os.close(fd)
        ts.append((time.perf_counter() - t) * 1e3)
        os.unlink(path)
    return {"fsync_p50_ms": statistics.median(ts), "fsync_p99_ms": float(np.percentile(ts, 99))}


def _until_stop(a: dict, step: Any) -> int:
    deadline = time.time() + a.get("max_s", 600)
    i = 0
    while not os.path.exists(a["stop"]) and time.time() < deadline:
        step(i)
        i += 1
    return i


def role_writer(a: dict) -> dict:
    store = open_store(a["design"], a["root"], fsync=a["fsync"])
    block = bytes(a["block_bytes"])
    base = 2 * 10**9 + os.getpid() * 10**5
    print(json.dumps({"ready": True}), flush=True)
    n = _until_stop(a, lambda i: put_chain(store, synthetic_keys(base + i, 0, a["per_put"]), 0, bytes(16), block))
    store.close()
    return {"puts": n}


PRESSURE_FILES = ("/proc/pressure/io", "/proc/pressure/cpu")   # Linux PSI; each line 1: "some ... total=µs"


def pressure_ms() -> tuple[float, float]:
    """The system's I/O and CPU pressure so far (PSI `some` totals, ms: time at least one task waited for the
    disk, or for a core); NaN where the kernel does not offer it."""
    out = []
    for path in PRESSURE_FILES:
        try:
            with open(path) as f:
                out.append(int(f.readline().rsplit("total=", 1)[1]) / 1e3)
        except (OSError, IndexError, ValueError):
            out.append(float("nan"))
    return out[0], out[1]


@dataclass(slots=True)
class OpCost:
    """Where one put or CHECK's wall time went. `cpu_ms` is its own thread's CPU time; a voluntary switch is a
    wait (a lock, the disk), an involuntary one the scheduler giving its core to another process; major faults
    are index pages read from disk; the pressures are the system's PSI `some` time across it (ms). Wall far
    above CPU with involuntary switches: the CPU was taken; with voluntary ones and I/O pressure: the disk."""

    kind: str
    wall_ms: float
    cpu_ms: float
    voluntary_switches: int
    involuntary_switches: int
    major_faults: int
    io_pressure_ms: float
    cpu_pressure_ms: float

    @classmethod
    def of(cls, kind: str, op: Any) -> OpCost:
        """Run `op()` and measure it."""
        (io0, cpu0), r0, c0 = pressure_ms(), resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        t0 = time.perf_counter()
        op()
        wall = (time.perf_counter() - t0) * 1e3
        c1, r1, (io1, cpu1) = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD), pressure_ms()
        return cls(kind, wall, (c1 - c0) * 1e3, r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw,
                   r1.ru_majflt - r0.ru_majflt, io1 - io0, cpu1 - cpu0)


def role_stall(a: dict) -> dict:
    store = open_store(a["design"], a["root"], fsync=False)
    led = BlockLedger(store)
    tokens = check_tokens()[:a.get("stall_check_tokens", 131072)]
    block = bytes(a["block_bytes"])
    base = 3 * 10**9 + os.getpid() * 10**5
    puts: list[OpCost] = []
    checks: list[OpCost] = []

    def step(i: int) -> None:
        keys = synthetic_keys(base + i, 0, a["per_put"])
        puts.append(OpCost.of("put", lambda: put_chain(store, keys, 0, bytes(16), block)))
        checks.append(OpCost.of("check", lambda: led.match_tokens(tokens, SPEC, namespace=NAMESPACE)))
        time.sleep(0.005)

    print(json.dumps({"ready": True}), flush=True)
    n = _until_stop(a, step)
    store.close()
    if not puts:
        return {"ops": 0, "max_put_ms": 0.0, "max_check_ms": 0.0, "put_p99_ms": 0.0, "max_put_major_faults": 0}
    worst_put = max(puts, key=lambda c: c.wall_ms)
    worst_check = max(checks, key=lambda c: c.wall_ms)
    return {"ops": n, "max_put_ms": worst_put.wall_ms, "max_check_ms": worst_check.wall_ms,
            "put_p99_ms": float(np.percentile([c.wall_ms for c in puts], 99)),
            "max_put_major_faults": worst_put.major_faults,   # page-cache misses (disk reads) of the slowest put
            "slowest": asdict(max(worst_put, worst_check, key=lambda c: c.wall_ms))}


def role_warm(a: dict) -> dict:
    path = data_file(Path(a["root"]))
    before = cached_share(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while f.readinto(buf):
            pass
    return {"index_cached_before": before, "index_cached": cached_share(path), "warm_s": time.perf_counter() - t}


def role_victims(a: dict) -> dict:
    store = open_store(a["design"], a["root"], fsync=False)
    block = bytes(a["block_bytes"])
    t = time.perf_counter()
    have, chain_id = 0, 5 * 10**9
    while have < a["blocks"]:
        n = min(CHAIN_BLOCKS, a["blocks"] - have)
        write_chain(store, synthetic_keys(chain_id, 0, n), a["per_put"], block, ttl_s=1.0)
        have += n
        chain_id += 1
    store.close()
    return {"victims_s": time.perf_counter() - t, "victims": have}


def role_gc(a: dict) -> dict:
    store = open_store(a["design"], a["root"])
    t = time.perf_counter()
    res = store.gc(batch=a.get("batch", 4096))
    gc_s = time.perf_counter() - t
    t = time.perf_counter()
    idle = store.gc(batch=a.get("batch", 4096))
    idle_s = time.perf_counter() - t
    store.close()
    return {"gc_s": gc_s, "gc_expired": res.expired, "gc_batches": res.batches, "gc_idle_s": idle_s,
            "gc_idle_expired": idle.expired}


ROLES = {"build": role_build, "rebuild": role_rebuild, "probe": role_probe, "fsync": role_fsync, "writer": role_writer,
         "stall": role_stall, "victims": role_victims, "gc": role_gc, "warm": role_warm}

if __name__ == "__main__":
    args = json.loads(sys.argv[2])
    print(json.dumps(ROLES[sys.argv[1]](args)), flush=True)
