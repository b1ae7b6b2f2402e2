"""`kvledger store stats|gc|verify`: operator views of a block ledger.

`--path DIR` opens a file store (it must exist), `--redis-url URL` a Redis one (it must
answer). Bad input → one line on stderr, exit 2; with `--json`, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path
from typing import Any

import lmdb

from kvledger.store.backend import BlockStore
from kvledger.util.output import CliError, emit_json


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("store", help="block ledger: stats, gc, verify")
    cmds = parser.add_subparsers(dest="store_command", required=True, parser_class=type(parser))

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--path", metavar="DIR", help="a file block store (directory); with --redis-url: its bytes")
        p.add_argument("--redis-url", metavar="URL", help="a Redis block store, e.g. redis://127.0.0.1:6379/0 "
                       "(a Redis Cluster: redis+cluster://HOST:PORT[,HOST:PORT...])")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    st = cmds.add_parser("stats", help="size, blocks, chains, per-class counts, oldest entry")
    common(st)
    st.set_defaults(func=cmd_stats)
    g = cmds.add_parser("gc", help="remove expired blocks (tails first); evict down to --capacity-gb")
    common(g)
    g.add_argument("--capacity-gb", type=float, default=None, help="file store: evict least recently hit above this")
    g.add_argument("--batch", type=int, default=4096, help="blocks removed per batch")
    g.set_defaults(func=cmd_gc)
    v = cmds.add_parser("verify", help="check every block's checksum; report and remove bad blocks")
    common(v)
    v.add_argument("--keep", action="store_true", help="report bad blocks without removing them")
    v.set_defaults(func=cmd_verify)


def open_store(args: argparse.Namespace, capacity_bytes: int | None = None) -> BlockStore:
    """The store named on the command line; `CliError` when it is missing or unreachable."""
    if args.path is None and args.redis_url is None:
        raise CliError("give --path DIR, --redis-url URL, or both (the cluster mode)")
    files = None
    if args.path is not None:
        from kvledger.store.file_backend import FileStore
        from kvledger.store.lmdb_store import LmdbStore

        root = Path(args.path)
        if not root.is_dir():
            raise CliError(f"{root}: no such directory")
        if not (root / "segments").is_dir():
            raise CliError(f"{root}: not a kvledger block store (no segments/ inside)")
        if args.redis_url is None:  # the embedded store: a directory of the previous layout is migrated once
            try:
                return LmdbStore(root, capacity_bytes=capacity_bytes, create=False)
            except (OSError, lmdb.Error) as e:
                raise CliError(f"{root}: cannot open ({getattr(e, 'strerror', None) or e})") from None
        try:
            files = FileStore(root, capacity_bytes=capacity_bytes, create=False)
        except OSError as e:
            raise CliError(f"{root}: cannot open ({e.strerror or e})") from None
    import redis

    from kvledger.store.redis_backend import RedisStore

    try:
        return RedisStore(args.redis_url, check=True, timeout_s=2.0, files=files)
    except ValueError as e:
        raise CliError(f"bad --redis-url {args.redis_url!r}: {e}") from None
    except (redis.RedisError, OSError) as e:
        raise CliError(f"cannot reach Redis at {args.redis_url}: {e}") from None


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

    store = open_store(args)
    try:
        st = store.stats()
    finally:
        store.close()
    if args.path is not None:
        st.snapshots, st.snapshot_bytes = snapshot_stats(args.path)
    if args.json:
        emit_json(st.as_dict())
        return
    _table(f"block ledger: {st.backend} {st.location}", [
        ("blocks", f"{st.blocks:,}"), ("chains", f"{st.chains:,}"), ("live bytes", f"{st.live_bytes:,}"),
        ("disk bytes" if st.backend == "file" else "server memory", f"{st.disk_bytes:,}"),
        *[(f"class {k}", f"{v:,}") for k, v in sorted(st.per_class.items())],
        *[(f"namespace {k}", f"{v:,}") for k, v in sorted(st.per_namespace.items())],
        ("oldest entry", _when(st.oldest_created)), ("next expiry", _when(st.next_expiry)),
        ("snapshot files", f"{st.snapshots:,}"), ("snapshot bytes", f"{st.snapshot_bytes:,}"),
    ])


def cmd_gc(args: argparse.Namespace) -> None:
    if args.batch <= 0:
        raise CliError("--batch must be positive")
    if args.capacity_gb is not None and not 1e-9 <= args.capacity_gb <= 1e9:
        raise CliError("--capacity-gb must lie in [1e-9, 1e9] (one byte to one exabyte)")
    cap = int(args.capacity_gb * 1e9) if args.capacity_gb is not None else None
    from kvledger.store.snapshots import collect_snapshots

    store = open_store(args, capacity_bytes=cap)
    try:
        res = store.gc(args.batch)._asdict()
        if args.path is not None:  # snapshot files follow their chain blocks (store/snapshots.py)
            snaps = collect_snapshots(args.path, store)
            res |= {"snapshots_removed": snaps.removed, "snapshot_bytes_freed": snaps.freed_bytes}
    finally:
        store.close()
    if args.json:
        emit_json(res)
    else:
        _table("gc", [(k, f"{v:,}") for k, v in res.items()])


def cmd_verify(args: argparse.Namespace) -> None:
    store = open_store(args)
    try:
        res = store.verify(remove=not args.keep)
    finally:
        store.close()
    if args.json:
        emit_json(res._asdict())
    else:
        _table("verify", [(k, f"{v:,}") for k, v in res._asdict().items()])
