"""The local server a replay starts when it is not given `--url`: one per routing policy, each on a
fresh data directory, stopped when its run ends (also when the replay is interrupted).

- `up`: `kvledger up --prefill N --decode M --routing POLICY --port P --data-dir D`; ready when its
  stdout prints `kvledger up: ready at URL`; stopped with SIGTERM (then SIGKILL to its process
  group after a grace period).
- `serve`: `kvledger serve --port P --data-dir D`, one engine (prefill and decode, no router: the
  policy is not applied, and the report says so).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from kvledger.util.serve_process import KVLEDGER, ServeProcess, free_port

LAUNCHERS = ("auto", "up", "serve")
READY = re.compile(r"kvledger up: ready at (http://\S+)")
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 60.0


def has_up() -> bool:
    """Whether this installation has `kvledger up` (the cluster launcher)."""
    try:
        p = subprocess.run([str(KVLEDGER), "up", "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


class UpProcess:
    """`kvledger up` as a subprocess of its own session; `url` once `start()` returns."""

    def __init__(self, data_dir: Path, policy: str, prefill: int, decode: int, model: str) -> None:
        self.data_dir, self.policy, self.prefill, self.decode, self.model = data_dir, policy, prefill, decode, model
        self.log = data_dir.parent / f"{data_dir.name}-up.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self._ready = threading.Event()

    def start(self) -> UpProcess:
        port = free_port()
        cmd = [str(KVLEDGER), "up", "--prefill", str(self.prefill), "--decode", str(self.decode),
               "--routing", self.policy, "--port", str(port), "--data-dir", str(self.data_dir)]
        if self.model != "smollm2-135m":
            cmd += ["--model", self.model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvledger up did not become ready: {self.tail()}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log, "a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if (m := READY.search(line)) and not self._ready.is_set():
                    self.url = m.group(1).rstrip("/")
                    self._ready.set()

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class LocalServer:
    """One local server for one policy: `url`, `engines` (prefill, decode) and `kind` once started."""

    def __init__(self, launcher: str, root: Path, policy: str, prefill: int, decode: int, model: str) -> None:
        assert launcher in ("up", "serve")
        self.kind, self.policy = launcher, policy
        data = root / f"{launcher}-{policy}"
        if launcher == "up":
            self.proc: UpProcess | ServeProcess = UpProcess(data, policy, prefill, decode, model)
            self.engines = (prefill, decode)
        else:
            self.proc = ServeProcess(data, "--max-concurrent-per-key", "256", model=model)
            self.engines = (1, 1)

    @property
    def url(self) -> str:
        return self.proc.url

    def __enter__(self) -> LocalServer:
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()
