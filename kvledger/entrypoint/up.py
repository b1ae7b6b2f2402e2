"""`kvledger up --prefill N --decode M`: a whole cluster on this machine, for trying it and for tests.

    redis-server (its data under <data-dir>/redis, kept across runs) ─┐
    kvledger engine --role prefill  ×N ──┐                            ├─ index, directory, registry
    kvledger engine --role decode   ×M ──┼─ blocks: <data-dir>/blocks ┘
    kvledger entrypoint (HTTP :port) ────┘

Each process gets one status line when it is ready, and one when it exits; its output goes to
<data-dir>/logs/<name>.log. stdout ends the start with `kvledger up: ready at http://HOST:PORT`.
Ctrl-C or SIGTERM stops it all: the entrypoint first, then the engines (each drains, see
engine/server.py), then Redis. The cluster token is <data-dir>/cluster.token (mode 0600).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.util.output import CliError

START_TIMEOUT_S = 600.0   # model loads: tens of seconds each on a loaded 2-core machine


@dataclass(slots=True)
class Child:
    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    ready: bool = False
    notes: list[str] = field(default_factory=list)


def register(sub: argparse._SubParsersAction) -> None:
    from kvledger.entrypoint.cli import default_data_dir, http_args
    from kvledger.entrypoint.router import POLICIES
    from kvledger.util.output import examples

    p = sub.add_parser("up", help="a local cluster: Redis, N prefill + M decode engines, an entrypoint",
                       description="A whole cluster on this machine, for trying it and for tests: redis-server (or "
                       "--redis-url),\nN prefill and M decode engines, and an entrypoint on --host:--port. Logs go "
                       "to <data-dir>/logs;\nCtrl-C or SIGTERM stops it all (entrypoint, then engines, then Redis).",
                       epilog=examples("kvledger up --prefill 2 --decode 1",
                                       "kvledger up --prefill 0 --decode 0 --both 1 --model tiny-v4 --port 8001"))
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
    p.add_argument("--routing", default="cache-aware", choices=POLICIES, help="how prefill engines are chosen")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests each engine batches at once")
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> None:
    from kvledger.entrypoint.cli import default_data_dir, is_loopback

    if min(args.prefill, args.decode, args.both) < 0 or args.prefill + args.both == 0:
        raise CliError("--prefill/--decode/--both must be >= 0, with at least one engine that prefills")
    if args.redis_url and args.redis_cluster:
        raise CliError("give --redis-url or --redis-cluster, not both")
    if args.api_keys is None and not is_loopback(args.host):
        raise CliError(f"--host {args.host}: without --api-keys the entrypoint binds to loopback only")
    data = (args.data_dir or default_data_dir().with_name("cluster")).resolve()
    Cluster(args, data).run()


class Cluster:
    def __init__(self, args: argparse.Namespace, data: Path) -> None:
        self.args, self.data = args, data
        self.logs = data / "logs"
        self.redis = None
        self.children: list[Child] = []
        self.stopping = False

    def run(self) -> None:
        from kvledger.util.cluster_token import load_token, new_token_file

        self.logs.mkdir(parents=True, exist_ok=True)
        token_file = self.data / "cluster.token"
        try:
            load_token(token_file)
        except ValueError:
            new_token_file(token_file)
        url = self.args.redis_url or self._start_redis()
        self.children = self._plan(url, token_file)
        signal.signal(signal.SIGTERM, lambda *_: self._request_stop())
        try:
            for child in self.children:
                self._spawn(child)
            self._wait_ready()
            print(f"kvledger up: ready at http://{self.args.host}:{self.args.port}", flush=True)
            while not self.stopping:
                self._watch()
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self._stop_all()

    def _start_redis(self) -> str:
        from kvledger.util.redis_server import RedisServer

        if self.args.redis_cluster:
            from kvledger.util.redis_cluster import RedisCluster

            self.redis = RedisCluster().start()
            _status("redis", f"pid {self.redis.nodes[0].proc.pid}", f"ready at {self.redis.url}  (3 masters)")
            return self.redis.url
        self.redis = RedisServer(data_dir=self.data / "redis", persist=True)
        (self.data / "redis").mkdir(parents=True, exist_ok=True)
        self.redis.start()
        _status("redis", f"pid {self.redis.proc.pid}", f"ready at {self.redis.url}  (data {self.data / 'redis'})")
        return self.redis.url

    def _plan(self, redis_url: str, token_file: Path) -> list[Child]:
        a = self.args
        common = ["--redis-url", redis_url, "--data-dir", str(self.data), "--token-file", str(token_file),
                  "--model", a.model, "--log-level", a.log_level]
        children = []
        for role, n in (("prefill", a.prefill), ("decode", a.decode), ("both", a.both)):
            for i in range(n):
                name = f"{role}-{i}"
                args = ["engine", "--role", role, "--engine-id", name, "--max-num-seqs", str(a.max_num_seqs), *common]
                children.append(Child(name, args, self.logs / f"{name}.log"))
        front = ["entrypoint", "--host", a.host, "--port", str(a.port), "--routing", a.routing, *common,
                 "--max-concurrent-per-key", str(a.max_concurrent_per_key), "--max-body-bytes", str(a.max_body_bytes)]
        for flag in ("api_keys", "max_prompt_tokens", "max_tokens_limit"):
            if getattr(a, flag) is not None:
                front += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
        children.append(Child("entrypoint", front, self.logs / "entrypoint.log"))
        return children

    def _spawn(self, child: Child) -> None:
        with open(child.log, "ab") as log:
            child.proc = subprocess.Popen([sys.executable, "-m", "kvledger", *child.args], stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(c.ready for c in self.children):
            if self.stopping:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise CliError(f"the cluster did not start within {START_TIMEOUT_S:.0f} s; logs in {self.logs}")
            self._watch()
            time.sleep(0.3)

    def _watch(self) -> None:
        """Status lines: a process that became ready, one that exited."""
        for c in self.children:
            assert c.proc is not None
            code = c.proc.poll()
            if code is not None and "exited" not in c.notes:
                c.notes.append("exited")
                _status(c.name, f"pid {c.proc.pid}", f"exited with {code}; log {c.log}")
                if not c.ready and not self.stopping:
                    raise CliError(f"{c.name} exited with {code} while starting: {_tail(c.log)}")
            elif code is None and not c.ready and self._is_ready(c):
                c.ready = True
                _status(c.name, f"pid {c.proc.pid}", "ready" + _where(c, self.args))

    def _is_ready(self, c: Child) -> bool:
        if c.name != "entrypoint":
            return " ready at " in _tail(c.log, 4000)
        try:
            with urllib.request.urlopen(f"http://{self.args.host}:{self.args.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _request_stop(self) -> None:
        self.stopping = True

    def _stop_all(self) -> None:
        """Entrypoint first (no new requests), then the engines (they drain), then Redis."""
        self.stopping = True
        groups = [[c for c in self.children if c.name == "entrypoint"], [c for c in self.children
                                                                          if c.name != "entrypoint"]]
        for group in groups:
            live = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for c in live:
                c.proc.send_signal(signal.SIGTERM)
            for c in live:
                try:
                    c.proc.wait(timeout=75)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(timeout=10)
                _status(c.name, f"pid {c.proc.pid}", f"stopped ({c.proc.returncode})")
        if self.redis is not None:
            self.redis.stop()
            _status("redis", "", "stopped")


def _where(c: Child, args: argparse.Namespace) -> str:
    if c.name == "entrypoint":
        return f" at http://{args.host}:{args.port} ({args.routing} routing)"
    line = next((ln for ln in _tail(c.log, 4000).splitlines() if " ready at " in ln), "")
    return " at " + line.rsplit(" ready at ", 1)[-1] if line else ""


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _status(name: str, pid: str, what: str) -> None:
    print(f"  {name:<12} {pid:<11} {what}", flush=True)
