"""`kvledger serve` as a real subprocess on a free loopback port (the server tests, `kvledger bench serve`),
and how kvledger starts and stops every child that must not outlive it: `spawn`, `terminate`, `terminate_all`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvledger.core import DEFAULT_MODEL
from kvledger.util.private_file import write_private

KVLEDGER = Path(sys.executable).parent / "kvledger"
START_TIMEOUT_S = 600.0   # model load: ~50 s at load average 25 on a 2-core machine, minutes at 35


def _die_with_parent(parent: int | None = None) -> None:
    """In the child, before exec (Linux): SIGTERM to it when the thread that started it ends (PR_SET_PDEATHSIG:
    the *thread*, so spawn from the main thread, or one that outlives the child). `parent`: the pid that
    spawned it; if that one died before the flag was set (the race PR_SET_PDEATHSIG leaves), exit now.
    SIGINT goes back to its default: the parent decides when its child stops, and a shell that started
    the parent with SIGINT ignored (a background job) does not speak for the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        _prctl()(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


@functools.cache
def _prctl() -> Callable[..., int]:
    """libc's prctl, found once in the parent: the child between fork and exec should not load libraries."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def spawn(cmd: Sequence[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen)` for a child that must not outlive this process: it gets SIGTERM when
    the spawning thread ends, by any means, SIGKILL included (see `_die_with_parent`). The one way kvledger
    starts its long-lived children (redis-server, engines, the entrypoint, fetchers, servers under test)."""
    with contextlib.suppress(OSError, AttributeError):
        _prctl()   # resolved here, not in the child
    return subprocess.Popen(list(cmd), preexec_fn=functools.partial(_die_with_parent, os.getpid()), **popen)


def free_port() -> int:
    """A loopback port free now; another process may take it before the caller binds it."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` different loopback ports free now (all held open together while they are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def terminate(proc: subprocess.Popen | None, grace_s: float) -> int | None:
    """SIGTERM (a graceful shutdown, as an operator does), SIGKILL after `grace_s`; the exit code (None: never
    started)."""
    return None if proc is None else terminate_all([proc], grace_s)[0]


def terminate_all(procs: Sequence[subprocess.Popen], grace_s: float,
                  hurry: Callable[[], bool] = lambda: False, sig: int = signal.SIGTERM) -> list[int]:
    """`sig` (SIGTERM: drain) to each running one (in order), then wait for them together; SIGKILL to those
    still running after `grace_s`, or as soon as `hurry()` says so (a second Ctrl-C). Their exit codes, in
    order."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    end = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < end and not hurry():
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return [p.wait(timeout=10) for p in procs]


class ServeProcess:
    """Start with `start()`, stop with `stop()` (SIGTERM: a graceful shutdown, as an operator does).
    `get` and `post` send `api_key` as a bearer token when it is set."""

    def __init__(self, data_dir: Path, *args: str, model: str = DEFAULT_MODEL,
                 keys: dict | None = None, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.data_dir = Path(data_dir)
        self.args = list(args)
        self.model = model
        self.keys_file: Path | None = None
        if keys is not None:
            self.keys_file = self.data_dir.parent / f"{self.data_dir.name}-keys.json"
            write_private(self.keys_file, json.dumps(keys))   # 0600: a key file others may read is refused
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log = self.data_dir.parent / f"{self.data_dir.name}-serve.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServeProcess:
        """Launch and wait until healthy."""
        return self.launch().wait_ready()

    def launch(self) -> ServeProcess:
        """Spawn the server, not waiting for it (`wait_ready`): several start at once. Launch from the thread that
        stops it: the child dies with the thread that spawned it (`spawn`)."""
        self.port = free_port()
        cmd = [str(KVLEDGER), "serve", "--port", str(self.port), "--data-dir", str(self.data_dir),
               "--model", self.model, *self.args]
        if self.keys_file is not None:
            cmd += ["--api-keys", str(self.keys_file)]
        with open(self.log, "ab") as log:
            self.proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        return self

    def wait_ready(self) -> ServeProcess:
        """Until /health answers 200; RuntimeError (the log's tail) when the server exits or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvledger serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kvledger serve did not become healthy in {START_TIMEOUT_S} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        return terminate(self.proc, 60)

    def _headers(self, headers: dict | None) -> dict:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **(headers or {})}

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        return request(self.url + path, headers=self._headers(headers))

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, raw = request(self.url + path, data, {"Content-Type": "application/json", **self._headers(headers)})
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, {"raw": raw.decode(errors="replace")}


def request(url: str, data: bytes | None = None, headers: dict | None = None,
            timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
