"""The peer connectors `kvledger bench vllm --model gemma3-270m` runs beside kvledger's, and what it
measures of them without importing vLLM.

| peer                         | where its KV goes                                    | outlives the vLLM process |
|------------------------------|------------------------------------------------------|---------------------------|
| SimpleCPUOffloadConnector    | backend `disk`: one file `<store>/kv.rank_0`         | no: unlinked at start/exit|
| MooncakeStoreConnector       | a `mooncake_client`'s memory segment (standalone     | yes, while the client runs|
|                              | store), found through `mooncake_master` on loopback  |                           |

`MooncakeLoopback` starts the master (RPC and its HTTP metadata server on 127.0.0.1) and one client
that owns the pool (`global_segment_size`), writes the JSON file vLLM reads (`MOONCAKE_CONFIG_PATH`,
mode `standalone-store`: the vLLM process contributes no segment, so a fresh vLLM finds what an earlier
one put), and reads the master's `master_allocated_bytes` (bytes the pool holds) from its metrics port.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.util.serve_process import free_port, spawn

ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception|Unavailable)\b: .*")
FRAME_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def failure_line(log: list[str]) -> str:
    """The last exception line of a vLLM log, with the frame that raised it ("file:line in fn: Error: ...");
    the log's last line when it holds none."""
    for i in range(len(log) - 1, -1, -1):
        found = ERROR_LINE.search(log[i])
        if found is None:
            continue
        for j in range(i - 1, -1, -1):
            frame = FRAME_LINE.search(log[j])
            if frame is not None:
                where = frame["file"].split("site-packages/")[-1]
                return f"{where}:{frame['line']} in {frame['fn']}: {found.group(0).strip()}"
        return found.group(0).strip()
    return log[-1].strip() if log else "no log"


def bytes_under(root: Path) -> dict[str, int]:
    """Apparent bytes of the files under a kvledger store: `snapshots` (state ledger files, `snapshots/`)
    and `blocks` (everything else: block segments and the index)."""
    out = {"blocks": 0, "snapshots": 0}
    if not root.exists():
        return out
    for path in root.rglob("*"):
        if path.is_file():
            kind = "snapshots" if "snapshots" in path.relative_to(root).parts[:1] else "blocks"
            out[kind] += path.stat().st_size
    return out


@dataclass(slots=True)
class MooncakeLoopback:
    """Mooncake's master and one pool-owning client on 127.0.0.1 (TCP), for the length of a `with`.

    `segment_bytes` is the pool; `config_path` the file to pass as MOONCAKE_CONFIG_PATH. Invariant:
    both processes are alive inside the `with`, or `__enter__` raised with the reason."""

    bin_dir: Path
    work: Path
    segment_bytes: int = 4 << 30
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    client_port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def config_path(self) -> Path:
        return self.work / "mooncake.json"

    def __enter__(self) -> MooncakeLoopback:
        master, client = self.bin_dir / "mooncake_master", self.bin_dir / "mooncake_client"
        if not master.exists():
            raise RuntimeError(f"{master} is missing: pip install mooncake-transfer-engine-non-cuda into .venv-vllm")
        self.work.mkdir(parents=True, exist_ok=True)
        metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self._spawn("master", [str(master), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
                               "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                               f"-http_metadata_server_port={self.http_port}", "-metrics_host=127.0.0.1",
                               f"-metrics_port={self.metrics_port}"])
        self._wait(lambda: self.allocated_bytes() >= 0, "master")
        self._spawn("client", [str(client), f"-master_server_address=127.0.0.1:{self.rpc_port}",
                               f"-metadata_server={metadata}", f"-global_segment_size={self.segment_bytes}",
                               "-protocol=tcp", "-host=127.0.0.1", f"-port={self.client_port}"])
        self._wait(self._client_listens, "client")
        self.config_path.write_text(json.dumps({
            "metadata_server": metadata, "master_server_address": f"127.0.0.1:{self.rpc_port}",
            "protocol": "tcp", "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
            "local_buffer_size": 512 << 20}))
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it until __exit__
        self.procs.append(spawn(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.work))   # dies with us

    def _wait(self, ready: object, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            try:
                if ready():  # type: ignore[operator]
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        tail = (self.work / f"{name}.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"mooncake {name} did not start: " + " | ".join(tail))

    def _client_listens(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.client_port), timeout=1.0):
            return True

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus metrics without labels (name → value)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
                out[parts[0]] = float(parts[1])
        return out

    def allocated_bytes(self) -> int:
        """Bytes the pool holds now (the master's `master_allocated_bytes`)."""
        return int(self.metrics().get("master_allocated_bytes", 0))

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs.clear()
