"""A vLLM engine in a child process (`driver.py` under `.venv-vllm`), for the tests and the bench.

    with VllmProcess({"model": DIR, "connector": "kvledger", "store": STORE}) as engine:
        result = engine.generate(prompt_ids, max_tokens=16)   # tokens, seconds, kv_transfer_params

This side imports no vLLM (the main virtualenv has none). Every wait has a timeout; a child
that dies or hangs raises `EngineError` with the tail of its log.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Any

from kvledger.engine.threads import peer_environment
from kvledger.integrations.vllm.driver import DEFAULT_ENV, MARK

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


class EngineError(RuntimeError):
    pass


class VllmProcess:
    """One driver process; `start_timeout_s` covers vLLM's import and engine start."""

    def __init__(self, opts: dict[str, Any], *, python: Path = VLLM_PYTHON, start_timeout_s: float = 900.0,
                 env: dict[str, str] | None = None) -> None:
        self.opts = opts
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.env = {**peer_environment(), **DEFAULT_ENV, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.log: deque[str] = deque(maxlen=60)
        self.start_s = 0.0
        self.hybrid_kv_cache_manager = False  # vLLM's, as the started engine reports it

    def __enter__(self) -> VllmProcess:
        if not self.python.exists():
            raise EngineError(f"{self.python} is missing: run `make vllm-venv`")
        self.proc = subprocess.Popen([str(self.python), "-m", "kvledger.integrations.vllm.driver",
                                      json.dumps(self.opts)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env, cwd=REPO)
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(self.start_timeout_s)
        assert ready.get("ready"), ready
        self.start_s = ready["start_s"]
        self.hybrid_kv_cache_manager = bool(ready.get("hybrid_kv_cache_manager"))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK):]))
            else:
                self.log.append(line.rstrip())
        self.lines.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            item = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineError(f"vLLM gave no answer in {timeout_s:.0f} s:\n" + "\n".join(self.log)) from None
        if item is None:
            raise EngineError("vLLM exited:\n" + "\n".join(self.log))
        return item

    def generate(self, prompt: list[int], *, max_tokens: int = 16, salt: str | None = None,
                 logprobs: int | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
        """Greedy completion of `prompt` (token ids): tokens, seconds, num_cached_tokens, kv_transfer_params, and
        per generated token the top `logprobs` log probabilities ({token id as str: logprob}; none unless asked)."""
        assert self.proc is not None and self.proc.stdin is not None
        job = {"prompt": prompt, "max_tokens": max_tokens, "salt": salt, "logprobs": logprobs}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (what the connector stored stays): a later repeat is the connector's hit."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.proc.stdin.flush()
        return bool(self._next(60.0)["reset"])

    def cpu_s(self) -> float:
        """CPU seconds the engine process has used so far (user + system; Linux /proc)."""
        assert self.proc is not None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=30)


def wait_all(engines: list[VllmProcess]) -> None:
    """Start several engines at once (their imports overlap); all or none."""
    started: list[VllmProcess] = []
    errors: list[BaseException] = []

    def enter(engine: VllmProcess) -> None:
        try:
            engine.__enter__()
            started.append(engine)
        except BaseException as e:  # noqa: BLE001 - re-raised below after cleanup
            errors.append(e)

    threads = [threading.Thread(target=enter, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for engine in engines:
            engine.__exit__(None, None, None)
        raise errors[0]
