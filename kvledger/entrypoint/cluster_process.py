"""`kvledger up` as a real subprocess on a free loopback port (the cluster tests, and the benches that run a cluster:
`kvledger bench replay`, `chaos`, `pd`, `topology`, `whatif`).

    with ClusterProcess(tmp / "c", prefill=2, decode=1, routing="round-robin") as c:
        c.url                        # the entrypoint, http://127.0.0.1:PORT
        c.members["decode-0"]        # Member(pid, url) of each process, from `up`'s status lines
        c.engine_get("decode-0", "/engine/v1/health")   # the internal API, with the cluster token
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from kvledger.core import DEFAULT_MODEL
from kvledger.engine.defaults import DEFAULTS
from kvledger.util.serve_process import spawn, terminate

START_TIMEOUT_S = 900.0   # several model loads at once on a loaded 2-core machine
STATUS = re.compile(r"^\s+(\S+)\s+pid (\d+)\s+ready(?: again)?(?: at (\S+))?")
READY = re.compile(r"^kvledger up: ready at http://[^:]+:(\d+)")


class Member(NamedTuple):
    pid: int
    url: str | None


class ClusterProcess:
    def __init__(self, data_dir: Path, *args: str, prefill: int = 2, decode: int = 1, both: int = 0,
                 routing: str = DEFAULTS.routing, model: str = DEFAULT_MODEL) -> None:
        self.data_dir = Path(data_dir)
        self.args = ["--prefill", str(prefill), "--decode", str(decode), "--both", str(both), "--routing", routing,
                     "--model", model, *args]
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.members: dict[str, Member] = {}
        self.lines: list[str] = []
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        """The URL of the Redis `up` started, with its password (from the 0600 file beside its data)."""
        url = self.members["redis"].url
        assert url is not None
        conf = self.data_dir / "redis" / "redis-auth.conf"
        password = conf.read_text().split()[1] if conf.exists() else None
        return url.replace("redis://", f"redis://:{password}@", 1) if password else url

    @property
    def token(self) -> str:
        return (self.data_dir / "cluster.token").read_text().strip()

    def start(self) -> ClusterProcess:
        """`up --port 0`: the port is the one `up` bound, read from its ready line (none can take it first)."""
        cmd = [sys.executable, "-m", "kvledger", "up", "--port", "0", "--data-dir", str(self.data_dir), *self.args]
        self.proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT_S) or self.proc.poll() is not None:
            out = "\n".join(self.lines[-20:])
            self.stop()
            raise RuntimeError(f"kvledger up did not become ready: {out}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            m = STATUS.match(line)
            if m:
                self.members[m.group(1)] = Member(int(m.group(2)), m.group(3))
            if (ready := READY.match(line)) is not None:
                self.port = int(ready.group(1))
                self._ready.set()
        self._ready.set()

    def engine_get(self, name: str, path: str) -> tuple[int, dict]:
        from kvledger.engine.session import engine_request

        member = self.members[name]
        assert member.url is not None
        status, raw = engine_request(member.url, path, self.token)
        return status, json.loads(raw or b"{}")

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.members[name].pid, sig)

    def wait_exit(self, name: str, timeout_s: float = 90.0) -> bool:
        """True once process `name` is gone (it is `up`'s child, so only its pid can be polled)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(self.members[name].pid, 0)
            except ProcessLookupError:
                return True
            if any(ln.strip().startswith(name) and ("exited" in ln or "stopped" in ln) for ln in self.lines):
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> int | None:
        return terminate(self.proc, 180)   # the engines drain, then Redis stops

    def __enter__(self) -> ClusterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
