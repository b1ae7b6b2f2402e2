"""The local server a replay starts when it is not given `--url`: one per routing policy, each on a
fresh data directory, stopped when its run ends (also when the replay is interrupted).

- `up` (the default): `kvledger up --prefill N --decode M --routing POLICY` (`entrypoint.cluster_process`),
  Redis and the engines included;
- `serve`: `kvledger serve`, one engine that prefills and decodes, no router (the policy is not
  applied, and the report says so).
"""

from __future__ import annotations

from pathlib import Path

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.serve_process import ServeProcess

LAUNCHERS = ("up", "serve")


class LocalServer:
    """One local server for one policy: `url`, `engines` (prefill, decode) and `description`."""

    def __init__(self, launcher: str, root: Path, policy: str, prefill: int, decode: int, model: str) -> None:
        assert launcher in LAUNCHERS
        data = root / f"{launcher}-{policy}"
        if launcher == "up":
            self.proc: ClusterProcess | ServeProcess = ClusterProcess(data, prefill=prefill, decode=decode,
                                                                      routing=policy, model=model)
            self.engines = (prefill, decode)
            self.description = f"kvledger up --prefill {prefill} --decode {decode} --routing {policy}"
        else:
            self.proc = ServeProcess(data, "--max-concurrent-per-key", "256", model=model)
            self.engines = (1, 1)
            self.description = "kvledger serve (one engine: routing not applied)"

    @property
    def url(self) -> str:
        return self.proc.url

    def __enter__(self) -> LocalServer:
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()
