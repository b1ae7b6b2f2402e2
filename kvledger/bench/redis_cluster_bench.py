"""`kvledger bench redis-cluster`: CHECK (and a directory lookup) on a 3-master Redis Cluster
side by side with one Redis server, both started here on loopback (or given by URL).

For each length (keys = blocks of a prompt), a chain of tiny blocks is stored on both (CHECK
reads metadata only), then CHECK runs `--reps` times per backend, interleaved, all present
(`hit`) and all absent (`cold`, another chain): median and min wall ms, the median of the
per-rep ratios cluster / single. On the one server the CHECK script of before (`OLD_MATCH`,
`single_old`) runs beside them, on the same blocks. Also a batch lookup of `--lookup` snapshot entries in the
RedisDirectory (one round trip on one server, two rounds on the cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.core import ModelSpec, chain_keys
from kvledger.util.output import CliError, emit_json

HELP = "CHECK and directory lookups on a 3-master Redis Cluster vs one Redis server"
EXAMPLES = ("kvledger bench redis-cluster --reps 41 --json",)  # `--help`'s epilog
MAX_KEYS = 1 << 20

# The baseline `single_old`: the CHECK script before Redis Cluster support (one server only): it builds
# key names inside Lua (prefix .. key), which Redis Cluster refuses; its keys travel as one blob.
OLD_MATCH = """
local blob, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local n = #blob / 16
local t = redis.call('TIME')
local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for i = 0, n - 1 do
  local k = prefix .. string.sub(blob, i * 16 + 1, i * 16 + 16)
  if redis.call('PEXPIREAT', k, at - i, 'GT') == 0 and redis.call('EXISTS', k) == 0 then
    return i
  end
end
return n
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.core.spec import PUBLISHED_MODEL

    p.add_argument("--keys", default="64,8192", help="CHECK lengths in blocks (8,192 blocks of 128 tokens: 1M tokens)")
    p.add_argument("--reps", type=int, default=41, help="interleaved CHECKs per backend, length and case")
    p.add_argument("--lookup", type=int, default=64, help="entries in one directory lookup (0: skip)")
    p.add_argument("--model", default=PUBLISHED_MODEL, help="block size from this ModelSpec preset")
    p.add_argument("--redis-url", default=None, help="a Redis server to use (default: one started here)")
    p.add_argument("--cluster-url", default=None, help="a redis+cluster:// URL (default: 3 masters started here)")


@contextlib.contextmanager
def _backends(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    from kvledger.util.redis_cluster import RedisCluster
    from kvledger.util.redis_server import RedisServer

    with contextlib.ExitStack() as stack:
        single = args.redis_url or stack.enter_context(RedisServer()).url
        cluster = args.cluster_url or stack.enter_context(RedisCluster()).url
        yield {"single": single, "cluster": cluster}


def _interleaved(fns: dict[str, Callable[[], int]], want: int, reps: int) -> dict[str, list[float]]:
    """Wall ms of each function, `reps` times, the order rotated every rep; asserts each answer."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps):
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            got = fns[k]()
            times[k].append((time.perf_counter() - t0) * 1e3)
            assert got == want, f"{k}: CHECK answered {got}, expected {want}"
    return times


def _summary(times: dict[str, list[float]], tag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, ts in times.items():
        out[f"{tag}_{k}_ms"] = round(statistics.median(ts), 4)
        out[f"{tag}_{k}_min_ms"] = round(min(ts), 4)
    out[f"{tag}_ratio"] = round(statistics.median(c / s for c, s in zip(times["cluster"], times["single"])), 3)
    return out


def check_latency(urls: dict[str, str], spec: ModelSpec, n_keys: int, reps: int) -> dict[str, float]:
    from kvledger.store.ledger import BlockLedger

    rng = np.random.default_rng(n_keys)
    keys = chain_keys(rng.integers(0, 50_000, n_keys * spec.block_size, dtype=np.uint32), spec)
    cold = chain_keys(rng.integers(0, 50_000, n_keys * spec.block_size, dtype=np.uint32), spec)
    prefix = f"bench{time.time_ns()}:"
    leds = {k: BlockLedger.open(redis_url=u, prefix=prefix, timeout_s=10.0) for k, u in urls.items()}
    try:
        for led in leds.values():
            led.put_chain(keys, [b"\0"] * n_keys)  # CHECK reads metadata only: block bytes do not matter
            assert led.match(keys) == n_keys and led.match(cold) == 0  # warm: scripts loaded, slot map learned
        old = _old_check(urls["single"], prefix, leds["single"].policy.resolve("default")[1])
        res: dict[str, float] = {}
        for case, chain, want in (("hit", keys, n_keys), ("cold", cold, 0)):
            fns = {k: (lambda led=led, chain=chain: led.match(chain)) for k, led in leds.items()}
            fns["single_old"] = lambda chain=chain: old(chain)
            res |= _summary(_interleaved(fns, want, reps), f"check_{n_keys}_{case}")
        for led in leds.values():
            led.delete(keys)
    finally:
        for led in leds.values():
            led.close()
    return res


def _old_check(url: str, prefix: str, ttl_s: float) -> Callable[[list[bytes]], int]:
    """CHECK with the script of before, on one server (the TTL of the ledger's default class, as its CHECK)."""
    import redis

    script = redis.Redis.from_url(url, socket_timeout=10.0).register_script(OLD_MATCH)
    return lambda chain: int(script(args=[b"".join(chain), int(ttl_s * 1000), prefix.encode() + b"b:"]))


def lookup_latency(urls: dict[str, str], n: int, reps: int) -> dict[str, float]:
    from kvledger.state.directory import Holder, SnapshotEntry
    from kvledger.state.redis_directory import RedisDirectory

    prefix = f"bench{time.time_ns()}:"
    dirs = {k: RedisDirectory(u, prefix=prefix, holder_ttl_s=600, entry_ttl_s=600) for k, u in urls.items()}
    holders = [Holder(f"e{i}", f"127.0.0.1:{7000 + i}") for i in range(4)]
    entries = [SnapshotEntry(i.to_bytes(16, "big"), holders[i % 4], 128 * (i + 1), 1 << 20, 1.7e9) for i in range(n)]
    keys = [e.key for e in entries]
    try:
        for d in dirs.values():
            for h in holders:
                d.heartbeat(h)
            d.publish(entries)
            assert d.lookup(keys) == entries
        fns = {k: (lambda d=d: sum(e is not None for e in d.lookup(keys))) for k, d in dirs.items()}
        return _summary(_interleaved(fns, n, reps), f"lookup_{n}")
    finally:
        for d in dirs.values():
            d.withdraw(keys, holders[0])
            d.close()


def run(args: argparse.Namespace) -> None:
    try:
        sizes = [int(x) for x in args.keys.split(",") if x.strip()]
        spec = ModelSpec.preset(args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    if not sizes or any(not 1 <= n <= MAX_KEYS for n in sizes):
        raise CliError(f"--keys: each length must be within 1..{MAX_KEYS:,}")
    if not 1 <= args.reps <= 10_000 or not 0 <= args.lookup <= 100_000:
        raise CliError("--reps must be within 1..10000 and --lookup within 0..100000")
    result: dict[str, Any] = {"bench": "redis-cluster", "masters": 3, "reps": args.reps, "keys": sizes,
                              "block_tokens": spec.block_size, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                        time.gmtime())}
    with _backends(args) as urls:
        for n in sizes:
            result |= check_latency(urls, spec, n, args.reps)
        if args.lookup:
            result |= lookup_latency(urls, args.lookup, args.reps)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "redis_cluster.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        emit_json(result)
    else:
        _print(result, sizes, args.lookup)


def _print(r: dict[str, Any], sizes: list[int], lookup: int) -> None:
    print(f"{'':28} {'single ms':>10} {'cluster ms':>11} {'cluster/single':>15} {'old script ms':>14}")
    rows = [(f"CHECK {n:,} keys, {case}", f"check_{n}_{case}") for n in sizes for case in ("hit", "cold")]
    rows += [(f"directory lookup of {lookup}", f"lookup_{lookup}")] if lookup else []
    for label, tag in rows:
        old = r.get(tag + "_single_old_ms")
        print(f"{label:28} {r[tag + '_single_ms']:>10.3f} {r[tag + '_cluster_ms']:>11.3f} {r[tag + '_ratio']:>15.2f} "
              f"{'-' if old is None else format(old, '.3f'):>14}")
