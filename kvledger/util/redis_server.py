"""A private redis-server on a free loopback port: for tests, benchmarks and `kvledger serve`
when no shared Redis is configured. Uses Debian's `redis-server` binary; it dies with the process
that started it (`serve_process.spawn`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvledger.util.serve_process import free_port, spawn, terminate


class RedisServer:
    """`with RedisServer() as r: r.url` — started on 127.0.0.1, data in a temp dir, stopped on exit.

    `stop()` ends it gracefully, `kill()` with SIGKILL (for fault tests); `start()` again
    restarts it on the same port and directory.
    """

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None, *, persist: bool = False,
                 password: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (make setup installs Debian's redis-server)")
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="kvledger-redis-")
        self.dir = Path(data_dir or self._tmp.name)
        self.persist = persist
        self.password = password
        self.extra_args = tuple(extra_args)  # more redis-server options, e.g. the cluster ones (RedisCluster)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def shown_url(self) -> str:
        """`url` without the password, for logs and status lines."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _auth_config(self) -> list[str]:
        """The password goes in a 0600 file in the data dir (`requirepass`, and `masterauth` for a cluster's
        nodes), never on the command line, which every local user can read in /proc."""
        if not self.password:
            return []
        path = self.dir / "redis-auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.password}\nmasterauth {self.password}\n")
        return [str(path)]

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        args = [self.binary, *self._auth_config(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "60 1" if self.persist else "", "--appendonly", "no",
                "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(self.dir / "redis.log")]
        args += list(self.extra_args)
        # its own session: a Ctrl-C at the terminal reaches the supervisor, which stops Redis last
        self.proc = spawn(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n" if not self.password else f"AUTH {self.password}\r\nPING\r\n".encode())
                    if b"PONG" in s.recv(64) or self.password:
                        return self
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        terminate(self.proc, 10)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
