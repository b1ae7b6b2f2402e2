"""Fixtures of the state-ledger tests: holder processes, and network namespaces where the machine allows."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HOLDER = Path(__file__).with_name("holder.py")


@dataclass
class HolderProc:
    """A holder.py subprocess; `info` is its ready line (address, pool, keys)."""

    proc: subprocess.Popen
    info: dict
    lines: queue.Queue = field(default_factory=queue.Queue)

    @property
    def address(self) -> str:
        return self.info["address"]

    def ask(self, line: str, timeout: float = 30.0) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.lines.get(timeout=timeout))

    def close(self) -> None:
        """Ask it to exit; SIGKILL it if it does not (or is stopped); make sure its segment is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # a SIGKILLed holder cannot unlink its segment; its resource tracker does, shortly after
        shm = Path("/dev/shm") / self.info["pool"].lstrip("/")
        deadline = time.monotonic() + 2
        while shm.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


@pytest.fixture
def spawn_holder():
    """spawn_holder(token=..., seed=..., netns=None, **flags) → a ready HolderProc (killed after the test)."""
    started: list[HolderProc] = []

    def spawn(*, token: str, seed: int, netns: str | None = None, timeout: float = 30.0, **flags: object) -> HolderProc:
        cmd = [sys.executable, str(HOLDER), "--token", token, "--seed", str(seed)]
        for k, v in flags.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).parents[2])
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        try:
            info = json.loads(lines.get(timeout=timeout))
        except queue.Empty:
            proc.kill()
            raise RuntimeError("holder did not start") from None
        h = HolderProc(proc, info, lines)
        started.append(h)
        return h

    yield spawn
    for h in started:
        h.close()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns_pair():
    """Two network namespaces joined by a veth pair on a private /30 that exists only inside them.

    Yields ((ns_a, ip_a), (ns_b, ip_b)), or (None, reason) where `ip netns` is not available
    here (not root, no `ip`, no netns support); the namespaces are removed after the test.
    """
    if shutil.which("ip") is None:
        yield None, "no `ip` command"
        return
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"kvl-{tag}-a", f"kvl-{tag}-b"
    veth_a, veth_b = f"kvl{tag}a", f"kvl{tag}b"
    octet = int(tag[:2], 16)  # 10.254.X.0/30: .1 and .2, only inside the two namespaces
    ip_a, ip_b = f"10.254.{octet}.1", f"10.254.{octet}.2"
    made: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, veth, addr in ((ns_a, veth_a, ip_a), (ns_b, veth_b, ip_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        for ns in made:
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)
        reason = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
        yield None, f"ip netns unavailable: {reason}"
        return
    try:
        yield (ns_a, ip_a), (ns_b, ip_b)
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)
