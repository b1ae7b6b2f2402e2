"""`kvledger bench store`: the block ledger against its floors, side by side in one run.

Throughput. Batches of whole blocks (sizes from a ModelSpec) go through the embedded store's `put` (LmdbStore)
and `get_into`, and the same bytes go through a plain sequential write (one file per
batch: `write` + `fsync`) and read (`preadv` of the file into the same buffer), on the same
filesystem, interleaved batch by batch, alternating which side goes first. Page cache, both sides
alike: every write is fsynced, and before the reads every file of both sides gets
`posix_fadvise(DONTNEED)`. kvledger does more per byte than the plain side (xxh3-64 of every
block on write and read, segment metadata, a rename and a directory fsync per batch).

CHECK. The latency of answering "how many leading blocks of this prompt are stored"
(all present), hashing included, from a numpy uint32 token array: embedded (LMDB index)
and Redis (one Lua call). Baseline: vLLM's default prefix-cache hashing — per block
sha256(pickle.dumps((parent_hash, tuple(block_tokens)))) over the tokens as a Python list,
plus one dict lookup per block. Converting a Python list to the array is reported apart.

Explained CHECK (`--explained`, issue 24). `match_explained` (the CHECK that also says why its first absent
block is absent: its tombstone) against plain `match`, the ledger call alone on precomputed keys (no hashing
to dilute the difference), embedded and Redis, at `--explained-keys` (64 and 1,024 keys: 8K and 128K-token
prompts), every block present (`hit`) and the chain's second half gone with tombstones (`half`: deleted,
so a tombstone each); p50 and p99 over `--explained-reps` interleaved reps, and the median per-rep ratio.
Redis also runs the CHECK script of before tombstones (`pre`) on the same keys: a hit again within the
refresh grain (`hit`, `half`: as a repeated prompt or a next turn) and, with every block's expiry set back
a day before each rep, untimed (`refresh`: each CHECK rewrites every expiry, and the tombstones' with them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.core import ModelSpec, chain_keys
from kvledger.util.output import CliError, dumps_strict, emit_json

HELP = "block ledger: read/write vs plain files, CHECK vs vLLM-style hashing"
EXAMPLES = ("kvledger bench store --json --out /tmp/storebench",)  # `--help`'s epilog
CHECK_TOKENS = (8192, 131072, 1048576)


MAX_CHECK_TOKENS = 1 << 26  # 64 M tokens: a prompt's ids alone are 256 MB


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.core.spec import PUBLISHED_MODEL

    p.add_argument("--model", default=PUBLISHED_MODEL, help="block size from this ModelSpec preset")
    p.add_argument("--dir", default=None, help="filesystem to measure (a temp dir is made inside; default /tmp)")
    p.add_argument("--total-mb", type=float, default=512, help="bytes per side per rep (MB)")
    p.add_argument("--blocks-per-put", type=int, default=256, help="blocks of one put / one plain file")
    p.add_argument("--reps", type=int, default=5, help="interleaved throughput reps")
    p.add_argument("--check-reps", type=int, default=31, help="interleaved CHECK reps per prompt length")
    p.add_argument("--check-tokens", default=",".join(map(str, CHECK_TOKENS)), help="prompt lengths for CHECK")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis CHECK (no redis-server started)")
    p.add_argument("--explained", action="store_true", help="also time match_explained against match (issue 24)")
    p.add_argument("--explained-keys", default="64,1024", help="CHECK lengths in blocks for --explained")
    p.add_argument("--explained-reps", type=int, default=301, help="interleaved reps per case for --explained")


# --- throughput --------------------------------------------------------------------------

def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_plain_file(path: Path, batch: np.ndarray) -> None:
    """`batch`'s bytes into a new file at `path` (`write` until all are written, then `fsync`): the plain side."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(batch).cast("B")
        while mv:
            mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_plain_file(path: Path, batch: np.ndarray) -> None:
    """The file at `path` into `batch` (`preadv` until it is full): the plain side."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mv = memoryview(batch).cast("B")
        off = 0
        while off < mv.nbytes:
            n = os.preadv(fd, [mv[off:]], off)
            assert n > 0, "plain file shorter than written"
            off += n
    finally:
        os.close(fd)


def _io_sides(ledger: Any, kb: list[list[bytes]], plain: list[Path], data: list[np.ndarray],
              out: list[np.ndarray], per_put: int) -> dict[str, Any]:
    """The four timed operations of one rep, each on batch i."""

    def kvl_write(i: int) -> None:
        r = ledger.put_chain(kb[i], list(data[i]), start_pos=i * per_put, parent=kb[i - 1][-1] if i else None)
        assert r.written == per_put, r

    def plain_write(i: int) -> None:
        write_plain_file(plain[i], data[i])

    def kvl_read(i: int) -> None:
        assert ledger.read_prefix(kb[i], list(out[i])) == per_put

    def plain_read(i: int) -> None:
        read_plain_file(plain[i], out[i])

    return {"kvl_write": kvl_write, "plain_write": plain_write, "kvl_read": kvl_read, "plain_read": plain_read}


def throughput(spec: ModelSpec, base: Path, total_bytes: int, per_put: int, reps: int) -> dict[str, Any]:
    from kvledger.store.ledger import BlockLedger

    bb = spec.block_bytes()
    n_batches = max(1, total_bytes // (bb * per_put))
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 256, (per_put, bb), dtype=np.uint8) for _ in range(n_batches)]
    out = [np.zeros_like(d) for d in data]  # touched once, so neither side pays first-touch page faults
    nbytes = n_batches * per_put * bb
    w_kvl, w_plain, r_kvl, r_plain, w_ratio, r_ratio = [], [], [], [], [], []
    for rep in range(reps):
        d = Path(tempfile.mkdtemp(prefix=f"rep{rep}-", dir=base))
        toks = rng.integers(0, 2**31, n_batches * per_put * spec.block_size, dtype=np.uint32)
        keys = chain_keys(toks, spec, namespace=f"bench-{rep}")
        kb = [keys[i * per_put:(i + 1) * per_put] for i in range(n_batches)]
        ledger = BlockLedger.open(path=d / "store")
        plain = [d / f"plain-{i}.bin" for i in range(n_batches)]

        sides = _io_sides(ledger, kb, plain, data, out, per_put)
        t = dict.fromkeys(("kvl_write", "plain_write", "kvl_read", "plain_read"), 0.0)
        # interleaved batch by batch, alternating which side goes first, so both see the same disk
        for pair in (("kvl_write", "plain_write"), ("kvl_read", "plain_read")):
            if pair[0] == "kvl_read":
                _drop_cache(sorted((d / "store" / "segments").rglob("*.kvs")) + plain)
            for i in range(n_batches):
                for name in (pair if (i + rep) % 2 == 0 else pair[::-1]):
                    t0 = time.perf_counter()
                    sides[name](i)
                    t[name] += time.perf_counter() - t0
        assert all(np.array_equal(a, b) for a, b in zip(data, out)), "read back differs"
        ledger.close()
        shutil.rmtree(d, ignore_errors=True)
        w_kvl.append(nbytes / t["kvl_write"])
        w_plain.append(nbytes / t["plain_write"])
        r_kvl.append(nbytes / t["kvl_read"])
        r_plain.append(nbytes / t["plain_read"])
        w_ratio.append(t["plain_write"] / t["kvl_write"])
        r_ratio.append(t["plain_read"] / t["kvl_read"])
    med = statistics.median
    return {
        "write_bytes_per_s": med(w_kvl), "read_bytes_per_s": med(r_kvl),
        "plain_write_bytes_per_s": med(w_plain), "plain_read_bytes_per_s": med(r_plain),
        "write_ratio": med(w_ratio), "read_ratio": med(r_ratio),
        "write_ratios": w_ratio, "read_ratios": r_ratio,
        "bytes_per_rep": nbytes, "batches_per_rep": n_batches,
    }


# --- CHECK ---------------------------------------------------------------------------------

def vllm_style_check(token_list: list[int], block_size: int, cached: dict[bytes, int], root: bytes) -> int:
    """The baseline: vLLM's default block hashing (sha256 of the pickled (parent, token tuple)) + lookups."""
    parent = root
    n = 0
    dumps, sha = pickle.dumps, hashlib.sha256
    hit = True
    for i in range(0, len(token_list) - block_size + 1, block_size):
        parent = sha(dumps((parent, tuple(token_list[i:i + block_size])), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        if hit and parent in cached:
            n += 1
        else:
            hit = False
    return n


def _check_variants(spec: ModelSpec, emb: Any, red: Any, arr: np.ndarray, lst: list[int],
                    cached: dict[bytes, int], root: bytes) -> dict[str, Any]:
    """Each timed CHECK variant of one prompt; each returns the number of leading blocks found."""
    n = len(lst) // spec.block_size
    variants = {
        "embedded": lambda: emb.match_tokens(arr, spec)[1],
        "baseline": lambda: vllm_style_check(lst, spec.block_size, cached, root),
        "embedded_from_list": lambda: emb.match_tokens(lst, spec)[1],
        "list_to_array": lambda: n if np.asarray(lst, dtype=np.uint32).size == len(lst) else -1,
        "hash_only": lambda: len(chain_keys(arr, spec)),
    }
    if red is not None:
        variants["redis"] = lambda: red.match_tokens(arr, spec)[1]
    return variants


def check_latency(spec: ModelSpec, base: Path, sizes: list[int], reps: int, redis_url: str | None) -> dict[str, Any]:
    from kvledger.store.ledger import BlockLedger

    rng = np.random.default_rng(11)
    B = spec.block_size
    emb = BlockLedger.open(path=base / "check-store", fsync=False)
    red = BlockLedger.open(redis_url=redis_url, timeout_s=10.0) if redis_url else None
    res: dict[str, Any] = {}
    rows = []
    for L in sizes:
        arr = rng.integers(0, 2**17, L, dtype=np.uint32)
        lst = arr.tolist()
        keys = chain_keys(arr, spec)
        tiny = [b"\0"] * len(keys)  # CHECK reads metadata only: block bytes do not matter here
        emb.put_chain(keys, tiny)
        if red is not None:
            red.put_chain(keys, tiny)
        root = hashlib.sha256(b"vllm-root").digest()
        cached: dict[bytes, int] = {}
        parent = root
        for i in range(0, L - B + 1, B):
            parent = hashlib.sha256(pickle.dumps((parent, tuple(lst[i:i + B])),
                                                 protocol=pickle.HIGHEST_PROTOCOL)).digest()
            cached[parent] = i // B
        want = L // B
        variants = _check_variants(spec, emb, red, arr, lst, cached, root)
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for rep in range(reps):
            for k in names[rep % len(names):] + names[:rep % len(names)]:
                c0, t0 = time.thread_time(), time.perf_counter()
                got = variants[k]()
                t1, c1 = time.perf_counter(), time.thread_time()
                times[k].append((t1 - t0) * 1e3)
                cpu[k].append((c1 - c0) * 1e3)
                assert got == want, f"{k}: CHECK answered {got}, expected {want}"
        tag = {8192: "8k", 131072: "128k", 1048576: "1m"}.get(L, str(L))
        for k, ts in times.items():
            res[f"check_ms_{tag}_{k}"] = statistics.median(ts)
            res[f"check_ms_{tag}_{k}_min"] = min(ts)
        ratios = [a / b for a, b in zip(times["embedded"], times["baseline"])]
        res[f"check_ratio_{tag}"] = statistics.median(ratios)
        for k in ("embedded", "baseline", "hash_only"):  # CPU time of this thread: blind to preemption
            res[f"check_cpu_ms_{tag}_{k}"] = statistics.median(cpu[k])
        res[f"check_cpu_ratio_{tag}"] = statistics.median([a / b for a, b in zip(cpu["embedded"], cpu["baseline"])])
        if red is not None:
            res[f"check_ratio_{tag}_redis"] = statistics.median(
                [a / b for a, b in zip(times["redis"], times["baseline"])])
        rows.append(L)
    emb.close()
    if red is not None:
        red.close()
    res["check_tokens"] = rows
    return res


# --- explained CHECK (tombstones) -----------------------------------------------------------

# The Redis CHECK script before tombstones (one server): every present block's expiry rewritten (GT), no tombstone.
PRE_TOMBSTONE_MATCH = """
local ttl, at = tonumber(ARGV[1]), ARGV[2]
local t = redis.call('TIME')
at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for i, k in ipairs(KEYS) do
  if redis.call('PEXPIREAT', k, at - (i - 1), 'GT') == 0 and redis.call('EXISTS', k) == 0 then
    return i - 1
  end
end
return #KEYS
"""


def _explained_variants(led: Any, keys: list[bytes], want: int) -> dict[str, Any]:
    """The timed CHECKs of one case: plain, explained, and on Redis the script before tombstones."""
    from kvledger.store.ttl import DEFAULT_CLASS, DEFAULT_CLASSES
    from kvledger.util.redis_fanout import Call, script_call

    def expect(got: int, what: str) -> int:
        assert got == want, f"{what} answered {got}, expected {want}"
        return got

    out = {"plain": lambda: expect(led.match(keys), "match"),
           "explained": lambda: expect(led.match_explained(keys).blocks, "match_explained")}
    store = led.store
    if getattr(store, "nodes", None) is not None:
        sha, ttl_ms = store.nodes.script(PRE_TOMBSTONE_MATCH), int(DEFAULT_CLASSES[DEFAULT_CLASS] * 1000)
        call = [Call(0, script_call(sha, keys, ttl_ms, "", head=store.bprefix))]
        out["pre"] = lambda: expect(int(store.nodes.run(call)[0]), "the script before tombstones")
    return out


def _set_back(led: Any, keys: list[bytes]) -> None:
    """Every block's expiry a day from now (tails first): the next CHECK must rewrite each one."""
    at = int(time.time() * 1000) + 86_400_000
    node = led.store.nodes.client()
    pipe = node.pipeline(transaction=False)
    for c, k in enumerate(keys):
        pipe.pexpireat(led.store._k(k), at - c)
    pipe.execute()


def _time_case(variants: dict[str, Any], reps: int, before: Any = None) -> dict[str, list[float]]:
    """ms of each variant per rep, interleaved in a rotating order; `before()` untimed before each call."""
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(reps):
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            if before is not None:
                before()
            t0 = time.perf_counter()
            variants[k]()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def _pct(ts: list[float], q: float) -> float:
    ts = sorted(ts)
    return ts[min(len(ts) - 1, int(q * len(ts)))]


def explained_check(base: Path, lengths: list[int], reps: int, redis_url: str | None) -> dict[str, Any]:
    """The explained-CHECK figures (module docstring): `explained_{backend}_{n}_{case}_{variant}_p50_ms` / `_p99_ms`
    and `explained_ratio_{backend}_{n}_{case}` (explained / plain, median per rep); on Redis
    `tombstone_ratio_{n}_{case}` (plain / pre: the CHECK with tombstone upkeep against the one before)."""
    from kvledger.store.ledger import BlockLedger

    rng = np.random.default_rng(13)
    ledgers = {"embedded": BlockLedger.open(path=base / "explained-store", fsync=False)}
    if redis_url:
        ledgers["redis"] = BlockLedger.open(redis_url=redis_url, timeout_s=10.0)
    res: dict[str, Any] = {"explained_keys": lengths, "explained_reps": reps}
    try:
        for n in lengths:
            full = [rng.bytes(16) for _ in range(n)]
            half = [rng.bytes(16) for _ in range(n)]
            for name, led in ledgers.items():
                led.put_chain(full, [b"\0"] * n)
                led.put_chain(half, [b"\0"] * n)
                led.delete(half[n // 2:])        # tombstones, tail first: the CHECK's first absent key has one
                assert led.match_explained(half).gone is not None
                cases = [("hit", full, n, None), ("half", half, n // 2, None)]
                if name == "redis":
                    cases += [("refresh", full, n, lambda led=led, full=full: _set_back(led, full))]
                for case, keys, want, before in cases:
                    times = _time_case(_explained_variants(led, keys, want), reps, before)
                    for variant, ts in times.items():
                        res[f"explained_{name}_{n}_{case}_{variant}_p50_ms"] = _pct(ts, 0.5)
                        res[f"explained_{name}_{n}_{case}_{variant}_p99_ms"] = _pct(ts, 0.99)
                    res[f"explained_ratio_{name}_{n}_{case}"] = statistics.median(
                        a / b for a, b in zip(times["explained"], times["plain"]))
                    if "pre" in times:
                        res[f"tombstone_ratio_{n}_{case}"] = statistics.median(
                            a / b for a, b in zip(times["plain"], times["pre"]))
    finally:
        for led in ledgers.values():
            led.close()
    return res


# --- entry -------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> None:
    try:
        spec = ModelSpec.preset(args.model)
        sizes = [int(x) for x in args.check_tokens.split(",") if x.strip()]
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        explained_keys = [int(x) for x in args.explained_keys.split(",") if x.strip()]
    except ValueError as e:
        raise CliError(f"--explained-keys: {e}") from None
    if args.explained and (not explained_keys or min(explained_keys) < 2 or max(explained_keys) > 1 << 16
                           or not 1 <= args.explained_reps <= 100_000):
        raise CliError("--explained-keys: lengths of 2..65,536 blocks; --explained-reps: 1..100,000")
    if args.reps < 1 or args.check_reps < 1 or args.blocks_per_put < 1 or args.total_mb <= 0:
        raise CliError("--reps, --check-reps, --blocks-per-put and --total-mb must be positive")
    for flag, value, limit in (("--reps", args.reps, 1000), ("--check-reps", args.check_reps, 10_000),
                               ("--blocks-per-put", args.blocks_per_put, 65_536), ("--total-mb", args.total_mb, 1e6)):
        if value > limit:
            raise CliError(f"{flag} is {value:g}, more than the limit of {limit:g}")
    if any(spec.block_size > L for L in sizes):
        raise CliError(f"--check-tokens: each length must be at least one block ({spec.block_size})")
    if any(L > MAX_CHECK_TOKENS for L in sizes):
        raise CliError(f"--check-tokens: each length must be at most {MAX_CHECK_TOKENS:,} tokens")
    if args.dir is not None and not Path(args.dir).is_dir():
        raise CliError(f"--dir {args.dir}: no such directory")
    base = Path(tempfile.mkdtemp(prefix="kvledger-bench-store-", dir=args.dir))
    server = None
    try:
        redis_url = None
        if not args.no_redis:
            from kvledger.util.redis_server import RedisServer

            server = RedisServer().start()
            redis_url = server.url
        tp = throughput(spec, base, int(args.total_mb * 1e6), args.blocks_per_put, args.reps)
        ck = check_latency(spec, base, sizes, args.check_reps, redis_url)
        if args.explained:
            ck |= explained_check(base, explained_keys, args.explained_reps, redis_url)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(base, ignore_errors=True)
    result = {
        "bench": "store", "model": spec.name, "block_bytes": spec.block_bytes(),
        "blocks_per_put": args.blocks_per_put, "reps": args.reps, "check_reps": args.check_reps,
        "filesystem": str(Path(args.dir or tempfile.gettempdir()).resolve()),
        "page_cache": "fsync after every batch (both); posix_fadvise DONTNEED on every file (both) before reads",
        "baseline_io": "one file per batch: write + fsync; read: preadv of the whole file into the same buffer",
        "baseline_check": "per block sha256(pickle.dumps((parent, tuple(tokens)))) over a Python list + dict lookup",
        **tp, **ck,
    }
    result["check_ms_1m_embedded"] = ck.get("check_ms_1m_embedded")
    result["check_ratio_1m"] = ck.get("check_ratio_1m")
    if args.out:
        _write_out(Path(args.out), result)
    if args.json:
        emit_json(result)
    else:
        _print(result)


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title=f"block ledger I/O ({r['model']}, {r['block_bytes']:,} B blocks, {r['blocks_per_put']} per put)")
    for col in ("", "kvledger GB/s", "plain GB/s", "ratio"):
        t.add_column(col, justify="right")
    for what in ("write", "read"):
        t.add_row(what, f"{r[f'{what}_bytes_per_s'] / 1e9:.2f}", f"{r[f'plain_{what}_bytes_per_s'] / 1e9:.2f}",
                  f"{r[f'{what}_ratio']:.2f}")
    c.print(t)
    t = Table(title="CHECK, all blocks present, hashing included (median ms)")
    for col in ("tokens", "embedded", "redis", "vLLM-style", "ratio", "list→array"):
        t.add_column(col, justify="right")
    for L in r["check_tokens"]:
        tag = {8192: "8k", 131072: "128k", 1048576: "1m"}.get(L, str(L))
        redis_ms = r.get(f"check_ms_{tag}_redis")
        t.add_row(f"{L:,}", f"{r[f'check_ms_{tag}_embedded']:.2f}", "-" if redis_ms is None else f"{redis_ms:.2f}",
                  f"{r[f'check_ms_{tag}_baseline']:.2f}", f"{r[f'check_ratio_{tag}']:.3f}",
                  f"{r[f'check_ms_{tag}_list_to_array']:.2f}")
    c.print(t)
    if "explained_keys" in r:
        _print_explained(c, r)


def _print_explained(c: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title="CHECK explained (tombstone of the first absent block) vs plain, ledger call only: p50 / p99 ms")
    for col in ("backend", "keys", "case", "plain", "explained", "ratio", "before tombstones", "ratio"):
        t.add_column(col, justify="right")
    for name in ("embedded", "redis"):
        for n in r["explained_keys"]:
            for case in ("hit", "half", "refresh"):
                key = f"explained_{name}_{n}_{case}"
                if f"{key}_plain_p50_ms" not in r:
                    continue
                cell = [f"{r[f'{key}_{v}_p50_ms']:.3f} / {r[f'{key}_{v}_p99_ms']:.3f}" if f"{key}_{v}_p50_ms" in r
                        else "-" for v in ("plain", "explained", "pre")]
                pre = r.get(f"tombstone_ratio_{n}_{case}")
                t.add_row(name, str(n), case, cell[0], cell[1], f"{r[f'explained_ratio_{name}_{n}_{case}']:.3f}",
                          cell[2], "-" if pre is None or name != "redis" else f"{pre:.3f}")
    c.print(t)


def _write_out(out: Path, r: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "store.json").write_text(dumps_strict(r, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = np.arange(2)
    ax.bar(x - 0.2, [r["write_bytes_per_s"] / 1e9, r["read_bytes_per_s"] / 1e9], 0.4, label="kvledger")
    ax.bar(x + 0.2, [r["plain_write_bytes_per_s"] / 1e9, r["plain_read_bytes_per_s"] / 1e9], 0.4, label="plain")
    ax.set_xticks(x, ["write", "read"])
    ax.set_ylabel("GB/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "store_io.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    Ls = r["check_tokens"]
    tags = [{8192: "8k", 131072: "128k", 1048576: "1m"}.get(L, str(L)) for L in Ls]
    for k, label in (("embedded", "kvledger embedded"), ("redis", "kvledger redis"), ("baseline", "vLLM-style")):
        ys = [r.get(f"check_ms_{t}_{k}") for t in tags]
        if all(y is not None for y in ys):
            ax.plot(Ls, ys, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("CHECK ms (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "store_check.png", dpi=120)
    plt.close(fig)
