"""`kvledger serve`: the embedded all-in-one server (OpenAI-compatible HTTP on the block ledger).

Without `--api-keys` the server is open to anyone who can reach it, so it binds to loopback
only and says so at startup; with a key file every request needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from kvledger.entrypoint.router import POLICIES
from kvledger.util.output import CliError

MODELS = ("smollm2-135m", "tiny-v4")


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/kvledger/serve (~/.local/share/kvledger/serve)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "kvledger" / "serve"


def register(sub: argparse._SubParsersAction) -> None:
    from kvledger.util.output import examples

    p = sub.add_parser("serve", help="the OpenAI-compatible server on the embedded store",
                       description="The embedded all-in-one server: OpenAI-compatible HTTP (/v1/completions, "
                       "/v1/chat/completions,\n/v1/models, /health, /metrics, the operator page at /) over the "
                       "block ledger in --data-dir/blocks.\nWithout --api-keys it is open to anyone who can reach "
                       "it, so it binds to loopback only.",
                       epilog=examples(
                           "kvledger serve",
                           "kvledger serve --model tiny-v4 --port 8001 --data-dir /tmp/kvl",
                           "kvledger serve --api-keys keys.json --host 0.0.0.0 --data-dir /var/lib/kvledger"))
    http_args(p)
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="block ledger folder (blocks under it), kept across restarts")
    p.add_argument("--no-cache", action="store_true", help="compute every prompt in full (a baseline)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests the engine batches at once")
    p.set_defaults(func=cmd_serve, redis_url=None, token_file=None, routing="cache-aware")

    p = sub.add_parser("entrypoint", help="a cluster's HTTP front: tokenizer, CHECK, router (no model weights)",
                       description="A cluster's HTTP front (the same API as serve): tokenizer, CHECK on the shared "
                       "index, and the router\nthat hands each request to an engine of the registry. It loads no "
                       "model weights.",
                       epilog=examples("kvledger entrypoint --redis-url redis://127.0.0.1:6379/0 --data-dir /mnt/kvl "
                                       "--token-file cluster.token"))
    http_args(p)
    p.add_argument("--redis-url", required=True, help="the cluster's Redis: index, directory, engine registry")
    p.add_argument("--data-dir", type=Path, required=True, help="the shared store folder (blocks under it)")
    p.add_argument("--token-file", type=Path, default=None, help="the cluster token (or $KVLEDGER_CLUSTER_TOKEN)")
    p.add_argument("--routing", default="cache-aware", choices=POLICIES, help="how prefill engines are chosen")
    p.set_defaults(func=cmd_serve, no_cache=False, max_num_seqs=8)


def http_args(p: argparse.ArgumentParser) -> None:
    from kvledger.core.spec import DEFAULT_MODEL

    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs --api-keys)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                   help='JSON: {"KEY": "namespace"} or {"KEY": {"namespace": ..., "ttl_class": ...}} '
                        "(default: none, open to every caller on loopback)")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS, help="the model served")
    p.add_argument("--max-concurrent-per-key", type=int, default=16, help="running + waiting requests of one API "
                   "key; more at once → 429")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies → 413 "
                   "(default: %(default)s = 4 MiB)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longer prompts → 400 (default: the context)")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="larger max_tokens → 400 (default: the context)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (info and debug add the access log)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from kvledger.entrypoint.auth import KeyFileError
    from kvledger.entrypoint.server import build_app
    from kvledger.entrypoint.state import ServeConfig, ServerState

    if args.api_keys is None and not is_loopback(args.host):
        raise CliError(f"--host {args.host}: without --api-keys the server is open to anyone, so it binds to "
                       "loopback only (127.0.0.1, ::1); give --api-keys FILE to listen elsewhere")
    if not 0 <= args.port < 65536:
        raise CliError("--port must lie in [0, 65535]")
    for flag in ("max_concurrent_per_key", "max_body_bytes", "max_num_seqs", "max_prompt_tokens", "max_tokens_limit"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be > 0")
    token = None
    if args.redis_url is not None:
        from kvledger.util.cluster_token import load_token

        try:
            token = load_token(args.token_file)
        except ValueError as e:
            raise CliError(str(e)) from None
    config = ServeConfig(model=args.model, host=args.host, port=args.port, data_dir=args.data_dir or default_data_dir(),
                         api_keys=args.api_keys, no_cache=args.no_cache, max_body_bytes=args.max_body_bytes,
                         max_concurrent_per_key=args.max_concurrent_per_key, max_num_seqs=args.max_num_seqs,
                         max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
                         redis_url=args.redis_url, cluster_token=token, routing=args.routing)
    try:
        state = ServerState(config)
    except (KeyFileError, OSError) as e:
        raise CliError(str(e)) from None
    tenants = "open: no --api-keys, every request is tenant 'default' (loopback only)" if state.keys is None \
        else f"{len(state.keys)} API keys, {len({t.namespace for t in state.keys.values()})} namespaces"
    mode = "serve" if args.redis_url is None else f"entrypoint ({args.routing} routing)"
    print(f"kvledger {mode}: {config.model} on http://{_url_host(config.host)}:{config.port}  "
          f"data {config.data_dir}  {tenants}{'  cache disabled' if config.no_cache else ''}",
          file=sys.stderr, flush=True)
    uvicorn.run(build_app(config, state), host=config.host, port=config.port, log_level=args.log_level,
                access_log=args.log_level in ("debug", "info"), timeout_graceful_shutdown=10)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
