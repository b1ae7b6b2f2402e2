"""`kvledger store stats|gc|verify|forget`: operator views of a block ledger, and forgetting a tenant in it.

`--path DIR` opens a file store: DIR itself when it holds `segments/`, or the store under it when
DIR is the `--data-dir` of `kvledger serve` / `up` (`store.ledger.blocks_dir`). `--redis-url URL`
opens a Redis one (it must answer). With neither, the store under serve's default data dir. A cluster
store's folder (`--path MOUNT` without `--redis-url`) is refused, never opened as an embedded store.
Bad input → one line on stderr, exit 2; with `--json`, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from kvledger.store.backend import BlockStore
from kvledger.store.ledger import BLOCKS_DIR, blocks_dir
from kvledger.store.open import StoreLocation, open_block_store
from kvledger.store.quota import Owner
from kvledger.util.output import CliError, emit_json, examples
from kvledger.util.redis_client import shown_url

SEGMENTS = "segments"   # what every file block store holds (store/segment_files.py)
MAX_CAPACITY_BYTES = 10**18   # --store-capacity at most one exabyte: past any store; larger is a typo (or inf)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("store", help="block ledger: stats, gc, verify, forget",
                            description="Operator views of a block ledger: a file store (a folder, or the "
                            "--data-dir of `kvledger serve`/`up`),\na Redis one, or both (the cluster mode). "
                            "With neither --path nor --redis-url, serve's default data dir.",
                            epilog=examples("kvledger store stats",
                                            "kvledger store gc --path DATA --store-capacity 50G",
                                            "kvledger store verify --redis-url redis://127.0.0.1:6379/0 --path MOUNT"))
    cmds = parser.add_subparsers(dest="store_command", required=True, parser_class=type(parser))
    _stats_parser(cmds)
    _gc_parser(cmds)
    _verify_parser(cmds)
    _forget_parser(cmds)


def _location_args(p: argparse.ArgumentParser) -> None:
    from kvledger.util.paths import default_data_dir

    p.add_argument("--path", metavar="DIR", help="a file block store, or the --data-dir of `kvledger serve`/`up` "
                   f"(its {BLOCKS_DIR}/ is used); with --redis-url: its bytes (default without --redis-url: "
                   f"serve's data dir, {default_data_dir()})")
    p.add_argument("--redis-url", metavar="URL", help="a Redis block store, e.g. redis://127.0.0.1:6379/0 "
                   "(a Redis Cluster: redis+cluster://HOST:PORT[,HOST:PORT...])")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _stats_parser(cmds: argparse._SubParsersAction) -> None:
    st = cmds.add_parser("stats", help="size, blocks, chains, per-class counts, oldest entry",
                         description="Size, blocks, chains, blocks per TTL class and per namespace, the oldest entry, "
                         "the next expiry,\nand the state ledger's snapshot files beside the blocks.",
                         epilog=examples("kvledger store stats", "kvledger store stats --path DATA --json"))
    _location_args(st)
    st.set_defaults(func=cmd_stats)


def _gc_parser(cmds: argparse._SubParsersAction) -> None:
    g = cmds.add_parser("gc", help="remove expired blocks (tails first); evict down to --store-capacity",
                        description="Remove expired blocks (chain tails first), then evict the least recently hit "
                        "down to\n--store-capacity, keeping the guarantees the store records (--quota of the server "
                        "that owns it),\nthen the snapshot files whose chain block is gone.",
                        epilog=examples("kvledger store gc --path DATA --store-capacity 50G --json"))
    _location_args(g)
    g.add_argument("--store-capacity", default=None, metavar="SIZE", help="the block ledger's size limit (8G, 500MB, "
                   "1TiB; as `kvledger serve --store-capacity`): evict least recently hit above this, keeping the "
                   "recorded guarantees (default: no limit)")
    g.add_argument("--batch", type=int, default=4096, help="blocks removed per batch")
    g.set_defaults(func=cmd_gc)


def _verify_parser(cmds: argparse._SubParsersAction) -> None:
    v = cmds.add_parser("verify", help="check every block's checksum; report and remove bad blocks",
                        description="Read every indexed block and check its checksum; bad blocks are reported and "
                        "removed\n(with --keep: only reported).",
                        epilog=examples("kvledger store verify --path DATA --keep --json"))
    _location_args(v)
    v.add_argument("--keep", action="store_true", help="report bad blocks without removing them")
    v.set_defaults(func=cmd_verify)


def _forget_parser(cmds: argparse._SubParsersAction) -> None:
    from kvledger.store.forget import DEFAULT_HOLD_S

    f = cmds.add_parser("forget", help="remove every block, tombstone and snapshot file of a tenant; print a receipt",
                        description="Forget a tenant (DESIGN rule 12): hold its writes for --hold-s seconds, so that "
                        "no late write\nbrings anything back, then remove every block of its namespace and of its "
                        "salted ones, every\ntombstone of them and the snapshot files beside the blocks. The receipt "
                        "counts what was removed.\nFor a running server use its POST /admin/forget instead: it also "
                        "clears the miss sample,\nthe trace and every engine's caches.",
                        epilog=examples("kvledger store forget --path DATA --namespace acme --json",
                                        "kvledger store forget --redis-url redis://127.0.0.1:6379/0 --path MOUNT "
                                        "--namespace acme"))
    _location_args(f)
    f.add_argument("--namespace", required=True, metavar="NAME",
                   help="the tenant: its namespace as --api-keys names it (\"default\" on an open server)")
    f.add_argument("--hold-s", type=float, default=DEFAULT_HOLD_S, metavar="SECONDS",
                   help="refuse the tenant's writes this long after (0: no hold)")
    f.set_defaults(func=cmd_forget)


def add_quota_arg(p: argparse.ArgumentParser) -> None:
    """`--quota NAME=SIZE` (repeatable): what `kvledger serve`, `entrypoint`, `engine` and `up` guarantee."""
    p.add_argument("--quota", action="append", default=[], metavar="NAME=SIZE",
                   help="a namespace's (or TTL class's: agent, chatbot; or namespace:NAME / class:NAME) guaranteed "
                   "share of --store-capacity, e.g. alpha=512MB: another tenant's traffic never evicts it below "
                   "that while anyone is above their own; repeatable (default: with --api-keys, capacity / (2 × "
                   "namespaces) each, or a key's own \"quota\"; none without)")


def cli_capacity(text: str | None, flag: str = "--store-capacity") -> int | None:
    """Bytes of a capacity flag, the one spelling of every command's (8G, 500MB, 1TiB; decimal units unless …iB);
    inf or absent: None. CliError naming `flag`, and its limits for a size outside [1 B, MAX_CAPACITY_BYTES]."""
    from kvledger.util.units import parse_size

    if text is None:
        return None
    try:
        size = parse_size(text)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None
    if size == float("inf"):
        return None
    if not 1 <= size <= MAX_CAPACITY_BYTES:
        raise CliError(f"{flag} must lie between one byte and one exabyte, or be inf")
    return int(size)


def cli_quotas(texts: list[str], classes: Iterable[str]) -> tuple[tuple[Owner, int], ...]:
    """The parsed `--quota` flags (quota.parse_quota); CliError naming the bad one."""
    from kvledger.store.quota import parse_quota

    out = []
    for text in texts:
        try:
            out.append(parse_quota(text, classes))
        except ValueError as e:
            raise CliError(f"--quota: {e}") from None
    return tuple(out)


def store_root(path: str | None, redis_url: str | None) -> Path | None:
    """The file block store the command line names: `--path` itself when it holds segments/, the
    store under it when it is a serve data dir, serve's default data dir when neither flag is given;
    None for Redis alone. `CliError` when there is no block store there."""
    if path is None and redis_url is not None:
        return None
    if path is None:
        from kvledger.util.paths import default_data_dir

        default = default_data_dir()
        if not _is_store(blocks_dir(default)):
            raise CliError(f"no --path or --redis-url given, and serve's default data dir {default} holds no "
                           "block store yet (start `kvledger serve`, or give --path DIR)")
        return blocks_dir(default)
    root = Path(path)
    if not root.is_dir():
        raise CliError(f"{root}: no such directory")
    for candidate in (root, blocks_dir(root)):
        if _is_store(candidate):
            return candidate
    raise CliError(f"{root}: not a kvledger block store ({SEGMENTS}/ inside) nor a serve data dir "
                   f"({blocks_dir(root).name}/{SEGMENTS}/ inside)")


def _is_store(root: Path) -> bool:
    return (root / SEGMENTS).is_dir()


def open_store(root: Path | None, redis_url: str | None, capacity_bytes: int | None = None) -> BlockStore:
    """The store at `root` (from `store_root`) and/or `redis_url` (`open_block_store`; a folder of the previous
    layout is migrated once); `CliError` when it cannot be opened or Redis does not answer."""
    import redis

    from kvledger.store.lmdb_store import NotEmbeddedFolder

    location = StoreLocation(None if root is None else str(root), redis_url)
    try:
        return open_block_store(location, capacity_bytes=capacity_bytes, create=False, check=True)
    except NotEmbeddedFolder as e:   # a cluster store, or a shared mount: nothing was written there
        raise CliError(f"{e}; give --redis-url URL, the Redis index of that store") from None
    except ValueError as e:
        raise CliError(f"bad --redis-url {shown_url(redis_url or '')!r}: {e}") from None
    except redis.RedisError as e:
        raise CliError(f"cannot reach Redis at {shown_url(redis_url or '')}: {e}") from None
    except (OSError, lmdb.Error) as e:
        if isinstance(e, OSError) and e.filename is None and redis_url is not None:  # a socket, not the folder
            raise CliError(f"cannot reach Redis at {shown_url(redis_url or '')}: {e}") from None
        raise CliError(f"{root}: cannot open ({getattr(e, 'strerror', None) or e})") from None


def _when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(title: str, rows: list[tuple[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    for k, v in rows:
        t.add_row(k, str(v))
    Console().print(t)


def cmd_stats(args: argparse.Namespace) -> None:
    from kvledger.store.snapshots import snapshot_stats

    root = store_root(args.path, args.redis_url)
    store = open_store(root, args.redis_url)
    try:
        st = store.stats()
    finally:
        store.close()
    if root is not None:
        st.snapshots, st.snapshot_bytes = snapshot_stats(root)
    if args.json:
        emit_json(st.as_dict())
        return
    _table(f"block ledger: {st.backend} {st.location}", [
        ("blocks", f"{st.blocks:,}"), ("chains", f"{st.chains:,}"), ("live bytes", f"{st.live_bytes:,}"),
        ("disk bytes" if st.backend == "file" else "server memory", f"{st.disk_bytes:,}"),
        *[(f"class {k}", f"{v:,}") for k, v in sorted(st.per_class.items())],
        *[(f"namespace {k}", f"{v:,}") for k, v in sorted(st.per_namespace.items())],
        *_quota_rows(st),
        ("oldest entry", _when(st.oldest_created)), ("next expiry", _when(st.next_expiry)),
        ("snapshot files", f"{st.snapshots:,}"), ("snapshot bytes", f"{st.snapshot_bytes:,}"),
    ])


def _quota_rows(st: Any) -> list[tuple[str, str]]:
    """Live bytes per tenant namespace beside its guarantee, and each class guarantee beside the class's bytes
    (the store's own totals; guarantees as the server that owns the store recorded them)."""
    g_ns, g_cls = st.guarantees.get("namespaces", {}), st.guarantees.get("classes", {})
    rows = [(f"namespace {ns} bytes", f"{st.namespace_bytes.get(ns, 0):,}"
             + (f" (guaranteed {g_ns[ns]:,})" if ns in g_ns else ""))
            for ns in sorted(set(st.namespace_bytes) | set(g_ns))]
    rows += [(f"class {c} bytes", f"{st.class_bytes.get(c, 0):,} (guaranteed {g:,})") for c, g in sorted(g_cls.items())]
    if st.capacity_bytes is not None:
        rows.append(("capacity", f"{st.capacity_bytes:,}"))
    return rows


def cmd_gc(args: argparse.Namespace) -> None:
    if args.batch <= 0:
        raise CliError("--batch must be positive")
    cap = cli_capacity(args.store_capacity)
    from kvledger.store.snapshots import collect_snapshots

    root = store_root(args.path, args.redis_url)
    store = open_store(root, args.redis_url, capacity_bytes=cap)
    try:
        res = store.gc(args.batch)._asdict()
        if root is not None:  # snapshot files follow their chain blocks (store/snapshots.py)
            snaps = collect_snapshots(root, store)
            res |= {"snapshots_removed": snaps.removed, "snapshot_bytes_freed": snaps.freed_bytes}
    finally:
        store.close()
    if args.json:
        emit_json(res)
    else:
        _table("gc", [(k, f"{v:,}") for k, v in res.items()])


def cmd_verify(args: argparse.Namespace) -> None:
    store = open_store(store_root(args.path, args.redis_url), args.redis_url)
    try:
        res = store.verify(remove=not args.keep)
    finally:
        store.close()
    if args.json:
        emit_json(res._asdict())
    else:
        _table("verify", [(k, f"{v:,}") for k, v in res._asdict().items()])


def cmd_forget(args: argparse.Namespace) -> None:
    from kvledger.store.forget import check_hold, check_tenant, forget_store

    for flag, check, value in (("--namespace", check_tenant, args.namespace), ("--hold-s", check_hold, args.hold_s)):
        try:
            check(value)
        except ValueError as e:
            raise CliError(f"{flag}: {e}") from None
    tenant, hold_s = args.namespace, args.hold_s
    root = store_root(args.path, args.redis_url)
    store = open_store(root, args.redis_url)
    try:
        got = forget_store(store, tenant, hold_s=hold_s, root=root)
    finally:
        store.close()
    receipt = {"object": "forget.receipt", "namespace": tenant, "store": got.receipt()}
    if args.json:
        emit_json(receipt)
    else:
        _table(f"forget {tenant}", [(k, "-" if v is None else _when(v) if k == "held_until" else f"{v:,}")
                                    for k, v in got.receipt().items()])
