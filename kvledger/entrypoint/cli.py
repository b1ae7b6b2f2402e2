"""`kvledger serve`: the embedded all-in-one server (OpenAI-compatible HTTP on the block ledger).

Without `--api-keys` the server is open to anyone who can reach it, so it binds to loopback
only and says so at startup; with a key file every request needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvledger.engine.defaults import DEFAULTS
from kvledger.engine.ledgers import Part
from kvledger.entrypoint.body_limit import BODY_TIMEOUT_S
from kvledger.entrypoint.config import DEFAULT_TTL_CLASSES, per_key_default
from kvledger.entrypoint.router import POLICIES
from kvledger.util.http_server import HEADER_TIMEOUT_S, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT
from kvledger.util.output import EXIT_INTERRUPTED, CliError
from kvledger.util.paths import default_data_dir
from kvledger.util.redis_client import REDIS_URL_ENV


def register(sub: argparse._SubParsersAction) -> None:
    from kvledger.engine.models.registry import add_checkpoint_arg
    from kvledger.engine.threads import add_stream_hits_arg, add_threads_arg
    from kvledger.util.output import examples

    p = sub.add_parser("serve", help="the OpenAI-compatible server on the embedded store",
                       description="The embedded all-in-one server: OpenAI-compatible HTTP (/v1/completions, "
                       "/v1/chat/completions,\n/v1/models, /health, /metrics, the operator page at /) over the "
                       "block ledger in --data-dir/blocks.\nWithout --api-keys it is open to anyone who can reach "
                       "it, so it binds to loopback only.",
                       epilog=examples(
                           "kvledger serve",
                           "kvledger serve --model tiny-v4 --port 8001 --data-dir /tmp/kvl",
                           "kvledger serve --model ~/models/my-llama.gguf   # or a Hugging Face folder",
                           "kvledger serve --api-keys keys.json --host 0.0.0.0 --data-dir /var/lib/kvledger"))
    http_args(p)
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="block ledger folder (blocks under it), kept across restarts")
    p.add_argument("--no-cache", action="store_true", help="compute every prompt in full (a baseline)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                   help="requests the engine batches at once")
    add_checkpoint_arg(p)
    add_threads_arg(p)
    add_stream_hits_arg(p)
    store_args(p)
    trace_args(p)
    grace_arg(p)
    p.set_defaults(func=cmd_serve, part=Part.EMBEDDED, redis_url=None, token_file=None, routing=DEFAULTS.routing,
                   listen_fd=None, no_tail_handoff=False)

    p = sub.add_parser("entrypoint", help="a cluster's HTTP front: tokenizer, CHECK, router (no model weights)",
                       description="A cluster's HTTP front (the same API as serve): tokenizer, CHECK on the shared "
                       "index, and the router\nthat hands each request to an engine of the registry. It loads no "
                       "model weights.",
                       epilog=examples("kvledger entrypoint --redis-url redis://127.0.0.1:6379/0 --data-dir /mnt/kvl "
                                       "--token-file cluster.token"))
    http_args(p)
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV), required=REDIS_URL_ENV not in os.environ,
                   help=f"the cluster's Redis: index, directory, engine registry (default: ${REDIS_URL_ENV}, which "
                   "keeps a password off the command line)")
    p.add_argument("--data-dir", type=Path, required=True, help="the shared store folder (blocks under it)")
    p.add_argument("--token-file", type=Path, default=None, help="the cluster token (or $KVLEDGER_CLUSTER_TOKEN)")
    p.add_argument("--routing", default=DEFAULTS.routing, choices=POLICIES, help="how prefill engines are chosen")
    p.add_argument("--no-tail-handoff", action="store_true", help="in P/D, let the decode leg recompute the prompt's "
                   "partial last block instead of pulling it from the prefill engine (a baseline)")
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # `kvledger up`'s bound socket
    cluster_store_args(p)
    trace_args(p)
    grace_arg(p)
    # an engine's batch (half of it: --max-concurrent-per-key with keys); no GC here, the engines' puts evict
    p.set_defaults(func=cmd_serve, part=Part.ENTRYPOINT, no_cache=False, max_num_seqs=DEFAULTS.max_num_seqs,
                   checkpoint_every=DEFAULTS.checkpoint_every, threads=None, stream_hits=DEFAULTS.stream_hits,
                   ttl_classes=DEFAULT_TTL_CLASSES, gc_interval_s=0.0, kv_cache_bytes=None)


def cluster_store_args(p: argparse.ArgumentParser) -> None:
    """A cluster's block ledger limits (`entrypoint`, `engine`, `up`): its capacity and the guarantees in it."""
    from kvledger.store.cli import add_quota_arg

    p.add_argument("--store-capacity", default=None, metavar="SIZE", help="the shared block ledger's size limit (8G, "
                   "500MB): a put past it evicts the least recently hit blocks down to 90%% of it, keeping each "
                   "--quota (default: none; Redis's maxmemory and the mount's size remain)")
    add_quota_arg(p)


def store_args(p: argparse.ArgumentParser) -> None:
    """The embedded block ledger's limits: its size, the guarantees in it and its TTL classes (what a what-if
    varies)."""
    from kvledger.store.cli import add_quota_arg
    p.add_argument("--store-capacity", default=None, metavar="SIZE", help="the block ledger's size limit (8G, 500MB, "
                   "1TiB): a put past it evicts the least recently hit blocks, tails first, down to 90%% of it "
                   "(default: none, the disk's)")
    p.add_argument("--ttl-classes", default=DEFAULT_TTL_CLASSES, metavar="SPEC", help="how long a block lives after "
                   "its last write or hit, per TTL class: agent=30s,chatbot=2h (units ms, s, m, h, d; a class not "
                   "named keeps its default) or one duration for every class (default %(default)s)")
    p.add_argument("--gc-interval-s", type=float, default=DEFAULTS.gc_interval_s, help="expired blocks are removed "
                   "(and the capacity enforced) this often while serving; 0: only at puts past the capacity (default "
                   "%(default)s)")
    add_quota_arg(p)
    p.add_argument("--kv-cache-bytes", default=None, metavar="SIZE", help="the engine's device KV pool (1G, 20M), "
                   "which is also its device prefix cache in front of the block ledger; at least one request of "
                   "--max-prompt-tokens + --max-tokens-limit tokens; a Llama's decode steps keep up to half as "
                   "much again in float32 copies of their sequences' KV (default: the engine's, "
                   f"{DEFAULTS.kv_cache_bytes >> 20} MiB)")


def trace_args(p: argparse.ArgumentParser) -> None:
    """The server's own trace (entrypoint/trace_recorder.py), which `kvledger whatif` reads."""
    p.add_argument("--no-trace", action="store_true", help="do not record the server's own trace: one Mooncake-format "
                   "line per finished request (hashes of its blocks, never tokens; its cached tokens and TTFT) in "
                   "DATA_DIR/trace/requests.jsonl, which `kvledger whatif --trace DATA_DIR` reads")
    p.add_argument("--trace-file-bytes", type=int, default=DEFAULTS.trace_file_bytes, help="the trace file is "
                   "rotated before a line would take it past this size (default %(default)s = "
                   f"{DEFAULTS.trace_file_bytes >> 20} MiB)")
    p.add_argument("--trace-files", type=int, default=DEFAULTS.trace_files, help="rotated trace files kept beside the "
                   "current one: at most (N + 1) x --trace-file-bytes on disk (default %(default)s)")
    p.add_argument("--trace-dir", type=Path, default=None, help="where the trace goes (default: DATA_DIR/trace)")


def trace_settings(args: argparse.Namespace) -> Any:
    """The TraceSettings of the trace flags; CliError for a bad one."""
    from kvledger.entrypoint.config import TraceSettings

    if args.trace_file_bytes < 1024 or args.trace_files < 0:
        raise CliError("--trace-file-bytes must be >= 1024 and --trace-files >= 0")
    return TraceSettings(not args.no_trace, args.trace_file_bytes, args.trace_files, args.trace_dir)


def store_limits(args: argparse.Namespace) -> tuple[int | None, dict[str, float], int | None]:
    """(capacity bytes or None, TTL seconds per class, device pool bytes or None) of the store flags; CliError
    for a bad one."""
    from kvledger.entrypoint.config import parse_ttl_classes
    from kvledger.store.cli import cli_capacity
    from kvledger.util.units import parse_size

    capacity = cli_capacity(args.store_capacity)
    try:
        ttl = parse_ttl_classes(args.ttl_classes)
    except ValueError as e:
        raise CliError(f"--ttl-classes: {e}") from None
    if args.gc_interval_s < 0:
        raise CliError("--gc-interval-s must be >= 0")
    kv = None
    if args.kv_cache_bytes is not None:
        try:
            size = parse_size(args.kv_cache_bytes)
        except ValueError as e:
            raise CliError(f"--kv-cache-bytes: {e}") from None
        if not 1 <= size < float("inf"):
            raise CliError("--kv-cache-bytes must be a finite size of at least one byte")
        kv = int(size)
    return capacity, ttl, kv


def cli_threads(requested: int | None) -> int:
    """The torch thread count of --threads (engine/threads.py); CliError for a bad one."""
    from kvledger.engine.threads import resolve_threads

    try:
        return resolve_threads(requested)
    except ValueError as e:
        raise CliError(str(e)) from None


def grace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grace-s", type=float, default=DEFAULTS.serve_grace_s, help="on SIGTERM: seconds requests in "
                   "flight get to finish before they end with a 503 (Ctrl-C ends them at once) (default %(default)s)")


def http_args(p: argparse.ArgumentParser) -> None:
    from kvledger.engine.models.registry import add_model_arg

    p.add_argument("--host", default=DEFAULTS.host, help="address to bind (non-loopback needs --api-keys)")
    p.add_argument("--port", type=int, default=DEFAULTS.port, help="HTTP port")
    p.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                   help='JSON: {"KEY": "namespace"} or {"KEY": {"namespace": ..., "ttl_class": ..., "role": '
                        '"operator", "quota": SIZE, "store": false}} (operator keys read /metrics and /dashboard and '
                        "publish and forget; the file must be yours and mode 0600) (default: none, open to every "
                        "caller on loopback)")
    p.add_argument("--public-prefix", type=Path, default=None, metavar="FILE",
                   help="JSON: a list of public prefixes (token-id lists, or strings tokenized as a prompt's start) "
                        "every tenant's prompt shares: their whole blocks are computed and stored once for all "
                        "tenants, and what follows stays each tenant's own (default: none)")
    add_model_arg(p)
    p.add_argument("--max-concurrent-per-key", type=int, default=None, help="running + waiting requests of one API "
                   f"key; more at once → 429 (default: with --api-keys half of --max-num-seqs, so one key never "
                   f"fills the batch; without, {DEFAULTS.open_per_key})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes, help="larger request bodies → 413 "
                   f"(default: %(default)s = {DEFAULTS.max_body_bytes >> 20} MiB)")
    p.add_argument("--header-timeout-s", type=float, default=HEADER_TIMEOUT_S, help="a request's headers not all "
                   "in within this long of the connection's start (or its previous response) → 408 and closed")
    p.add_argument("--body-timeout-s", type=float, default=BODY_TIMEOUT_S, help="a request body not all in within "
                   "this long of its headers → 408 and closed")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, help="open connections at most; at the "
                   "cap a new one takes the place of an idle connection of the client holding the most (if it holds 2 "
                   "more), else it is closed at accept; lowered to fit the fd limit, with a line saying so")
    p.add_argument("--max-connections-per-client", type=int, default=None, help="open connections of one client "
                   "address (an IPv6 /64) at most; one more is closed at accept. Behind a proxy every client is "
                   f"the proxy: raise it to --max-connections (default: {MAX_CONNECTIONS_PER_CLIENT}, or an eighth "
                   "of --max-connections when less)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longer prompts → 400 (default: the context)")
    p.add_argument("--max-tokens-limit", type=int, default=DEFAULTS.max_tokens_limit, help="larger max_tokens → 400 "
                   "(default %(default)s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="info: an access log line per request and the status lines (default %(default)s)")
    p.add_argument("--status-interval-s", type=float, default=DEFAULTS.status_interval_s,
                   help="a status line (throughput, prefix cache hit rate) per this many seconds of activity; "
                        "0: none (default %(default)s)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> None:
    from kvledger.engine.models.registry import cli_checkpoint, cli_resolve
    from kvledger.engine.threads import stream_hits
    from kvledger.entrypoint.server_state import ServeConfig
    from kvledger.store.cli import cli_quotas
    from kvledger.util.http_server import adopt, listen

    if args.api_keys is None and not is_loopback(args.host):
        raise CliError(f"--host {args.host}: without --api-keys the server is open to anyone, so it binds to "
                       "loopback only (127.0.0.1, ::1); give --api-keys FILE to listen elsewhere")
    if not 0 <= args.port < 65536:
        raise CliError("--port must lie in [0, 65535]")
    every = cli_checkpoint(cli_resolve(args.model), args.checkpoint_every)
    if args.status_interval_s < 0 or args.grace_s < 0:
        raise CliError("--status-interval-s and --grace-s must be >= 0")
    for flag in ("max_concurrent_per_key", "max_body_bytes", "max_num_seqs", "max_prompt_tokens", "max_tokens_limit",
                 "header_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_client"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be > 0")
    token, embedded = None, args.part is Part.EMBEDDED   # the mode, chosen by the command (`serve`, `entrypoint`)
    if not embedded:
        from kvledger.util.cluster_token import load_token

        try:
            token = load_token(args.token_file)
        except ValueError as e:
            raise CliError(str(e)) from None
    capacity, ttl_classes, kv_cache_bytes = store_limits(args)
    quota_flags = cli_quotas(args.quota, ttl_classes)
    threads = cli_threads(args.threads) if embedded else None   # an entrypoint computes nothing
    trace = trace_settings(args)
    data_dir = writable_dir(args.data_dir or default_data_dir(), "--data-dir")
    # before the model load: a busy port fails at once
    sock = listen(args.host, args.port) if args.listen_fd is None else adopt(args.listen_fd)
    port = sock.getsockname()[1]
    per_key = args.max_concurrent_per_key or per_key_default(args.max_num_seqs, args.api_keys is not None)
    config = ServeConfig(part=args.part, model=args.model, host=args.host, port=port, data_dir=data_dir,
                         api_keys=args.api_keys, public_prefix=args.public_prefix, no_cache=args.no_cache,
                         max_body_bytes=args.max_body_bytes,
                         body_timeout_s=args.body_timeout_s,
                         max_concurrent_per_key=per_key, max_num_seqs=args.max_num_seqs,
                         max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                         redis_url=args.redis_url, cluster_token=token, routing=args.routing,
                         tail_handoff=not args.no_tail_handoff,
                         status_every_s=args.status_interval_s, checkpoint_every=every, ttl_classes=ttl_classes,
                         store_capacity_bytes=capacity, quota_flags=quota_flags, gc_interval_s=args.gc_interval_s,
                         trace=trace,
                         kv_cache_bytes=kv_cache_bytes, stream_hits=stream_hits(args.stream_hits))
    mode = "serve" if embedded else "entrypoint"
    state, code = None, EXIT_INTERRUPTED   # until the server ran to its end: close as fast as after a Ctrl-C
    try:
        state = _open_state(config)
        _load(state, mode, args.routing, threads)
        code = _run(config, state, mode, sock, args)
    except KeyboardInterrupt:   # Ctrl-C before the server ran (during the load)
        code = EXIT_INTERRUPTED
    finally:
        if state is not None:
            if code == EXIT_INTERRUPTED:
                state.interrupted = True
            state.close()
        sock.close()
    if code == EXIT_INTERRUPTED:   # all we own is closed: skip the interpreter's teardown (~0.5-2 s with torch)
        print(f"kvledger {mode}: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
    raise SystemExit(code)


def _open_state(config: Any) -> Any:
    from kvledger.engine.models.registry import ModelError
    from kvledger.entrypoint.auth import KeyFileError
    from kvledger.util.public_prefix import PublicPrefixError
    from kvledger.entrypoint.server_state import ServerState

    try:
        return ServerState(config)
    except (KeyFileError, ModelError, PublicPrefixError) as e:   # a model's tokenizer that cannot be built, say
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"--data-dir {config.data_dir}: cannot open the ledgers ({e.strerror or e})") from None
    except ValueError as e:   # cluster mode: the folder is not the volume the Redis index describes
        raise CliError(f"--data-dir {config.data_dir}: {e}") from None


def _load(state: Any, mode: str, routing: str, threads: int | None) -> None:
    """Load the model on `threads` torch threads (embedded mode; None in an entrypoint, which computes nothing),
    saying what it does on stderr."""
    from kvledger.entrypoint.auth import tenant_count

    config = state.config
    tenants = "open: no --api-keys, every request is tenant 'default' (loopback only)" if state.keys is None \
        else f"{len(state.keys)} API keys, {tenant_count(state.keys)} namespaces"
    what = f"{mode} ({routing} routing)" if mode == "entrypoint" else mode
    print(f"kvledger {what}: {config.model}  data {config.data_dir}  {tenants}"
          f"{'  cache disabled' if config.no_cache else ''}", file=sys.stderr, flush=True)
    if state.quotas:
        print(f"kvledger {mode}: {state.quotas.describe(config.store_capacity_bytes)}", file=sys.stderr, flush=True)
    if threads is not None:
        from kvledger.engine.threads import set_threads

        threads = set_threads(threads)
        print(f"kvledger {mode}: loading {config.model} (computing on {threads} torch threads) ...", file=sys.stderr,
              flush=True)
        started = time.perf_counter()
        state.load_engine()
        print(f"kvledger {mode}: loaded in {time.perf_counter() - started:.1f} s ({state.hits_mode})",
              file=sys.stderr, flush=True)


def _run(config: Any, state: Any, mode: str, sock: socket.socket, args: argparse.Namespace) -> int:
    """Serve until a signal (util/http_server.py): Ctrl-C ends what is in flight with an error at once; SIGTERM
    lets it finish for up to `--grace-s` seconds first. Returns the exit status."""
    from kvledger.entrypoint.server import build_app
    from kvledger.util.http_server import Config, Server

    log_level, grace_s = args.log_level, args.grace_s

    def drain() -> None:
        if state.loop is not None:
            state.loop.call_soon_threadsafe(state.loop.call_later, grace_s, state.stop_requests)

    configure_logging(log_level)
    uv = Config(build_app(config, state), log_level=log_level, access_log=log_level in ("debug", "info"),
                timeout_graceful_shutdown=int(grace_s) + 5, log_config=None, header_timeout_s=args.header_timeout_s,
                max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client)
    server = Server(uv, on_interrupt=state.interrupt, on_terminate=drain,
                    ready=f"kvledger {mode}: ready at http://{_url_host(config.host)}:{config.port}")
    server.run(sockets=[sock])
    return server.exit_code


def configure_logging(level: str) -> None:
    """One line per record on stderr for kvledger's and uvicorn's loggers (access log included at info)."""
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def writable_dir(path: Path, flag: str) -> Path:
    """`path`, created if missing (0700: the ledgers' bytes and namespace names are the user's alone); CliError
    naming `flag` when it cannot be created or written. A folder that exists keeps its mode."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise CliError(f"{flag} {path}: {'not writable' if path.is_dir() else 'cannot create it'} "
                       f"({e.strerror or e})") from None
    return path


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
