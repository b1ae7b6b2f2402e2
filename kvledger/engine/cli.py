"""`kvledger engine --role prefill|decode|both`: one engine process of a cluster (see process.py)."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from kvledger.engine.defaults import DEFAULTS
from kvledger.util.output import CliError, examples
from kvledger.util.redis_client import REDIS_URL_ENV


def register(sub: argparse._SubParsersAction) -> None:
    from kvledger.engine.models.registry import add_checkpoint_arg, add_model_arg
    from kvledger.engine.threads import add_stream_hits_arg, add_threads_arg
    from kvledger.store.cli import add_quota_arg

    p = sub.add_parser("engine", help="one engine of a cluster (prefill, decode or both) on a shared Redis",
                       description="One engine process of a cluster: it loads the model, opens the shared ledgers "
                       "(Redis index, blocks\nunder --data-dir), serves the internal API behind the cluster token "
                       "and heartbeats into the registry.\nSIGTERM: it hands its requests back and drains for up to "
                       "--grace-s.",
                       epilog=examples("kvledger engine --role prefill --redis-url redis://127.0.0.1:6379/0 "
                                       "--data-dir /mnt/kvl --token-file cluster.token"))
    p.add_argument("--role", required=True, choices=("prefill", "decode", "both"), help="what the router sends it")
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV), required=REDIS_URL_ENV not in os.environ,
                   help=f"the cluster's Redis: index, directory, engine registry (default: ${REDIS_URL_ENV}, which "
                   "keeps a password off the command line)")
    p.add_argument("--data-dir", type=Path, required=True, help="the shared store folder (blocks under it)")
    p.add_argument("--token-file", type=Path, default=None, help="the cluster token (or $KVLEDGER_CLUSTER_TOKEN)")
    add_model_arg(p)
    add_checkpoint_arg(p)
    add_threads_arg(p)
    add_stream_hits_arg(p)
    p.add_argument("--host", default=DEFAULTS.host, help="address of the internal API and the state server")
    p.add_argument("--port", type=int, default=0, help="internal API port (0: any free one)")
    p.add_argument("--engine-id", default=None, help="default: <role>-<random>")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                   help="requests the engine batches at once")
    p.add_argument("--grace-s", type=float, default=DEFAULTS.engine_grace_s,
                   help="on SIGTERM: seconds to hand off and drain")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (info and debug add the access log)")
    p.add_argument("--store-capacity", default=None, metavar="SIZE", help="the shared block ledger's size limit: "
                   "this engine's puts past it evict least recently hit blocks down to 90%% of it, keeping each "
                   "--quota (default: none)")
    add_quota_arg(p)
    p.set_defaults(func=cmd_engine)


def cmd_engine(args: argparse.Namespace) -> None:
    from kvledger.engine.process import EngineConfig, EngineProcess, build_engine_app
    from kvledger.engine.models.registry import cli_checkpoint, cli_resolve
    from kvledger.engine.threads import resolve_threads, set_threads, stream_hits
    from kvledger.util.cluster_token import load_token
    from kvledger.util.http_server import listen

    if not 0 <= args.port < 65536:
        raise CliError("--port must lie in [0, 65535]")
    if args.max_num_seqs <= 0 or args.grace_s < 0:
        raise CliError("--max-num-seqs must be > 0 and --grace-s >= 0")
    every = cli_checkpoint(cli_resolve(args.model), args.checkpoint_every)
    try:
        token = load_token(args.token_file)
        threads = resolve_threads(args.threads)
    except ValueError as e:
        raise CliError(str(e)) from None
    engine_id = args.engine_id or f"{args.role}-{uuid.uuid4().hex[:6]}"
    capacity, quotas = engine_quotas(args)
    config = EngineConfig(model=args.model, role=args.role, redis_url=args.redis_url, token=token,
                          data_dir=args.data_dir, engine_id=engine_id, host=args.host,
                          max_num_seqs=args.max_num_seqs, grace_s=args.grace_s, checkpoint_every=every,
                          stream_hits=stream_hits(args.stream_hits), store_capacity_bytes=capacity, quotas=quotas)
    sock = listen(args.host, args.port)
    set_threads(threads)   # before the model loads, on the main thread: torch's every thread takes it
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    try:
        proc = EngineProcess(config)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot open the cluster's ledgers: {e}") from None
    run_draining(build_engine_app(proc, url), sock, proc.on_stop_signal, grace_s=args.grace_s,
                 log_level=args.log_level)


def engine_quotas(args: argparse.Namespace) -> tuple[int | None, Any]:
    """(capacity bytes or None, the `--quota` guarantees, or None without any: those the store records, which the
    entrypoint resolved with the key file). An engine knows no key file: `kvledger up` hands each engine the
    entrypoint's resolved guarantees as `--quota` flags. CliError for a bad flag."""
    from kvledger.store.cli import cli_capacity, cli_quotas
    from kvledger.store.quota import resolve_quotas
    from kvledger.store.ttl import DEFAULT_CLASSES

    capacity = cli_capacity(args.store_capacity)
    if not args.quota:
        return capacity, None
    return capacity, resolve_quotas(capacity, cli_quotas(args.quota, DEFAULT_CLASSES), None)


def run_draining(app: Any, sock: socket.socket, on_exit: Any, *, grace_s: float, log_level: str) -> None:
    """uvicorn on an already bound socket; the first SIGTERM/SIGINT calls `on_exit()` (hand-off), then
    uvicorn stops accepting and waits up to `grace_s` for open streams before it shuts down. A
    BaseException from `on_exit` (StartupInterrupted) goes on into the code the signal interrupted, with
    uvicorn already set to exit. Exit status: 130 after SIGINT, 0 after SIGTERM (util/http_server.py)."""
    from kvledger.util.http_server import MAX_CONNECTIONS, Config, Server

    # its clients are the cluster's own (an entrypoint holds up to 256 connections to it: remote.py), so one
    # address may hold half, not the default eighth
    config = Config(app, log_level=log_level, access_log=log_level in ("debug", "info"),
                    timeout_graceful_shutdown=int(max(grace_s, 1)), max_connections_per_client=MAX_CONNECTIONS // 2)
    server = Server(config, on_interrupt=on_exit, on_terminate=on_exit)
    server.run(sockets=[sock])
    raise SystemExit(server.exit_code)
