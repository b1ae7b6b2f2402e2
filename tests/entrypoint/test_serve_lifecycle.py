"""`kvledger serve` as a person meets it: started, interrupted and stopped as a real process.

Ctrl-C reaches a terminal's whole foreground process group, so the tests start the server in a
group of its own and signal the group (the fetcher process included), as a terminal would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvledger.engine.fetcher import STREAMS_HERE
from kvledger.util.serve_process import free_port, spawn

KVLEDGER = Path(sys.executable).parent / "kvledger"
STOP_BOUND_S = 2.0   # the bound for a Ctrl-C, whatever is in flight


class Serve:
    """One `kvledger serve` in its own process group; stderr read line by line on a thread."""

    def __init__(self, tmp: Path, *args: str, model: str = "tiny-v4") -> None:
        self.data = tmp / "data"
        cmd = [str(KVLEDGER), "serve", "--model", model, "--data-dir", str(self.data), *args]
        self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((ln for ln in self.lines if text in ln), None)
            if hit is not None:
                return hit
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.stderr}"
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout} s: {self.stderr}")

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    @property
    def url(self) -> str:
        return self.wait_for(" ready at ").rsplit(" ready at ", 1)[1]

    def ctrl_c(self) -> tuple[int, float]:
        """SIGINT to the group, as a terminal's Ctrl-C; (exit status, seconds until the process ended)."""
        started = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(timeout=60)
        return code, time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            with_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


def with_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def processes_in(pgid: int) -> list[str]:
    """Command lines of the live processes of a process group (zombies are dead: not counted)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return out


def no_process_left(pgid: int, within_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := processes_in(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def serve(tmp_path):
    started: list[Serve] = []

    def start(*args: str, model: str = "tiny-v4") -> Serve:
        started.append(Serve(tmp_path, *args, model=model))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# max_tokens: the default --max-tokens-limit, minutes of decode
LONG = {"model": "tiny-v4", "prompt": list(range(5, 300)), "max_tokens": 4096, "ignore_eos": True}


def test_ready_line_names_the_real_port_of_port_0_and_the_load_its_threads(serve):
    server = serve("--port", "0", "--threads", "2")
    url = server.url
    port = int(url.rsplit(":", 1)[1])
    assert port > 0 and url == f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200
    loading = server.wait_for("loading tiny-v4")
    assert "(computing on 2 torch threads)" in loading, loading
    assert server.lines.index(loading) < server.lines.index(server.wait_for("ready at"))


@pytest.mark.parametrize("flag, says", [("on", "(hits streamed)" if STREAMS_HERE else "(hits read before computing)"),
                                        ("off", "(hits read before computing)")])
def test_stream_hits_reaches_the_engine(serve, flag, says):
    """A full-attention model streams its hits as told, where the CPU allows it (tiny-v4, windowed, never does)."""
    server = serve("--port", "0", "--stream-hits", flag, model="smollm2-135m")
    assert server.url
    assert says in server.wait_for("loaded in"), server.lines


def test_ctrl_c_mid_request_ends_both_kinds_of_request_with_an_error_and_stops_at_once(serve):
    server = serve("--port", "0")
    url = server.url
    plain: dict = {}
    streamed: list[str] = []

    def plain_request() -> None:
        plain["status"], plain["body"] = post(url + "/v1/completions", LONG)

    def streamed_request() -> None:
        req = urllib.request.Request(url + "/v1/completions", json.dumps({**LONG, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            streamed.extend(line.decode().strip() for line in r if line.strip())

    threads = [threading.Thread(target=plain_request), threading.Thread(target=streamed_request)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while sum(ln.startswith("data: {") for ln in streamed) < 3:   # both are decoding now
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)
    code, took = server.ctrl_c()
    for t in threads:
        t.join(timeout=30)
    assert code == 130, server.stderr
    assert took <= STOP_BOUND_S, f"Ctrl-C took {took:.2f} s"
    assert plain["status"] == 503 and json.loads(plain["body"])["error"]["code"] == "server_shutting_down"
    assert json.loads(streamed[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert streamed[-1] == "data: [DONE]"
    assert "Traceback" not in server.stderr and server.lines[-1] == "kvledger serve: interrupted"
    assert no_process_left(server.proc.pid) == []


def test_ctrl_c_during_the_model_load_stops_at_once(serve):
    server = serve("--port", "0", model="smollm2-135m")
    server.wait_for("loading smollm2-135m")
    time.sleep(0.3)   # inside the load (it takes seconds)
    code, took = server.ctrl_c()
    assert code == 130 and took <= STOP_BOUND_S, (code, took, server.stderr)
    assert not any("ready at" in ln for ln in server.lines), "the load ended before the Ctrl-C: not a mid-load test"
    assert "Traceback" not in server.stderr and server.lines[-1] == "kvledger serve: interrupted"
    assert no_process_left(server.proc.pid) == []


@pytest.mark.parametrize("after_s", [0.3, 0.6, 1.0])
def test_ctrl_c_in_the_first_instants_is_one_line(serve, after_s):
    """From kvledger's first line of code on (its imports, the parser, the store, the load), a Ctrl-C is the
    130 of a Ctrl-C and one line. Before that, in CPython's own start (its `site` import, the first ~0.1 s),
    a SIGINT is CPython's to report ("Fatal Python error: init_import_site"), which no program can change."""
    server = serve("--port", "0")
    time.sleep(after_s)
    code, took = server.ctrl_c()
    server._reader.join(timeout=5)
    assert code == 130 and took <= STOP_BOUND_S, (code, took, server.stderr)
    assert "Traceback" not in server.stderr, server.stderr
    assert len(server.lines) <= 4, server.stderr


def test_sigterm_drains_then_exits_0(serve):
    server = serve("--port", "0")
    url = server.url
    status, body = post(url + "/v1/completions", {**LONG, "max_tokens": 4})
    assert status == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.stderr
    assert "Traceback" not in server.stderr


def test_busy_port_is_one_line_and_exit_2_before_any_load(serve):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = serve("--port", str(port), model="smollm2-135m")
        code = server.proc.wait(timeout=30)
    server._reader.join(timeout=5)
    assert code == 2, server.stderr
    assert server.lines == [f"kvledger: error: --port {port}: cannot listen on 127.0.0.1:{port}: "
                            "Address already in use"]


@pytest.mark.parametrize(("data_dir", "why"), [("/proc/kvl", "cannot create it"), ("/proc/self", "not writable")])
def test_unusable_data_dir_names_the_flag_and_exits_2(run_cli, data_dir, why):
    r = run_cli("serve", "--model", "tiny-v4", "--port", str(free_port()), "--data-dir", data_dir)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"kvledger: error: --data-dir {data_dir}: {why}") and r.stderr.count("\n") == 1


def test_access_log_and_status_line_at_the_default_log_level(serve):
    server = serve("--port", "0", "--status-interval-s", "1")
    url = server.url
    for _ in range(2):
        assert post(url + "/v1/completions", {**LONG, "prompt": list(range(5, 600)), "max_tokens": 2})[0] == 200
    access = server.wait_for('"POST /v1/completions HTTP/1.1" 200')
    assert "INFO uvicorn.access" in access
    line = server.wait_for("prefix cache hit rate", timeout=30)
    assert "requests done" in line and "tokens/s" in line and "since the start" in line
