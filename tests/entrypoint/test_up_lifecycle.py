"""`kvledger up` never leaves a process behind: not when its stdout's reader leaves (`| head -n 2`), not
on Ctrl-C while the models load or while a request runs, not when `up` itself is SIGKILLed.

Each test runs a real `kvledger up --model tiny-v4 --prefill 1 --decode 1` on a free loopback port,
with its own data dir. A process belongs to that cluster when its command line names the data dir
(up, the engines, the entrypoint, the fetchers: `--path <data>/blocks`), when it runs in it
(redis-server works in <data>/redis and rewrites its command line), or when its environment carries
the test's tag (every descendant: multiprocessing's resource trackers too). A `Census` thread notes
every such process from the start, so "nothing left" covers all the cluster ever had, and whatever a
test leaves is SIGKILLed at its end (the old code leaked)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvledger.util.serve_process import free_port, spawn

TAG = "KVLEDGER_TEST_CLUSTER"
START_S = 600.0   # the cluster's start: two model loads on a loaded 2-core machine
GONE_S = 20.0     # every process of the cluster gone, after what stops it (measured: see each test)
EXIT_S = 10.0     # `up` exits, after a Ctrl-C (measured: see each test)


def _role(cmd: str, cwd: str, data: str) -> str:
    if "redis-server" in cmd or cwd.startswith(f"{data}/redis"):
        return "redis"
    for needle, role in (("kvledger.engine.fetcher", "fetcher"), (" engine --role ", "engine"),
                         (" entrypoint ", "entrypoint"), (" up ", "up")):
        if needle in cmd:
            return role
    return "other"   # a resource tracker, found by the tag


def members(data: Path) -> dict[int, str]:
    """pid → role of each live process of the cluster at `data` (zombies are dead: not counted)."""
    tag, found = f"{TAG}={data}".encode(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(data) in cmd or cwd.startswith(str(data)) or tag in env:
            found[int(entry.name)] = _role(cmd, cwd, str(data))
    return found


class Census:
    """Every process the cluster ever had (pid → role), noted every 50 ms by a thread of its own."""

    def __init__(self, data: Path) -> None:
        self.data, self.seen = data, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.seen.update(members(self.data))

    def roles(self) -> list[str]:
        return sorted(dict(self.seen).values())

    def wait_gone(self, timeout_s: float) -> tuple[dict[int, str], float]:
        """(what is still alive after `timeout_s`, seconds until the last one went)."""
        t0 = time.monotonic()
        while (left := members(self.data)) and time.monotonic() - t0 < timeout_s:
            time.sleep(0.05)
        return left, time.monotonic() - t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for pid in members(self.data):   # a leak of the code under test must not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster_dir(tmp_path):
    data = tmp_path / "cluster"
    census = Census(data)
    yield data, census
    census.close()


def start_up(data: Path, port: int, *extra: str, model: str = "tiny-v4", **popen) -> subprocess.Popen:
    """`kvledger up` (this checkout's code: PYTHONPATH and the working directory are inherited), its own session,
    so a signal reaches `up` alone, as a terminal's Ctrl-C reaches only its foreground process group."""
    cmd = [sys.executable, "-m", "kvledger", "up", "--model", model, "--prefill", "1", "--decode", "1",
           "--port", str(port), "--data-dir", str(data), *extra]
    # SIGINT goes back to its default in the child (spawn); SIGHUP too, here: a test run under nohup would
    # otherwise start `up` ignoring it, and `up` keeps a signal it was started ignoring ignored (a feature)
    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        return spawn(cmd, env={**os.environ, TAG: str(data)}, start_new_session=True, **popen)
    finally:
        signal.signal(signal.SIGHUP, hup)


class Lines:
    """`up`'s stdout, read by a thread: `wait_for(text)` until a line containing it arrives."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def wait_for(self, text: str, timeout_s: float = START_S) -> None:
        end = time.monotonic() + timeout_s
        while not any(text in ln for ln in self.lines):
            assert self.proc.poll() is None, f"up exited with {self.proc.returncode}: {self.lines}"
            assert time.monotonic() < end, f"no {text!r} in {timeout_s} s: {self.lines}"
            time.sleep(0.05)


def _catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (uvicorn's, installed just before the app's startup: for an
    engine, the model load)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_the_status_printer_turns_into_a_sink_when_the_reader_leaves():
    """LinePrinter on a real pipe: lines arrive while the reader is there; once it closes its end, the
    printer notices without writing (POLLERR) or at the next write (EPIPE), and never raises."""
    from kvledger.util.output import LinePrinter

    for notice in ("poll", "write"):
        read, write = os.pipe()
        with os.fdopen(write, "w") as stream, os.fdopen(read, "rb") as reader:
            out = LinePrinter(stream)
            out.line("one")
            assert reader.readline() == b"one\n" and not out.reader_left()
            reader.close()
            if notice == "poll":
                assert out.reader_left()
            for _ in range(3):
                out.line("two " * 10_000)   # more than one write's worth: the first EPIPE, then dropped
            assert out.gone and out.reader_left()


def test_a_closed_stdout_pipe_stops_every_child(cluster_dir):
    """`kvledger up | head -n 2`: head reads two status lines and exits, closing the pipe; `up` must
    then stop redis-server, both engines, their fetchers and the entrypoint, and exit 0."""
    data, census = cluster_dir
    read, write = os.pipe()
    up = start_up(data, free_port(), stdout=write, stderr=subprocess.DEVNULL)
    os.close(write)
    head = subprocess.run(["head", "-n", "2"], stdin=read, capture_output=True, text=True, timeout=START_S)
    os.close(read)
    t0 = time.monotonic()
    assert len(head.stdout.splitlines()) == 2 and "redis" in head.stdout, head.stdout
    left, took = census.wait_gone(GONE_S)
    assert not left, f"left behind {time.monotonic() - t0:.1f} s after the pipe closed: {left}"
    assert up.wait(timeout=5) == 0
    roles = census.roles()   # fetchers too, of the engines that got as far as loading
    assert {"up", "redis", "entrypoint"} <= set(roles) and roles.count("engine") == 2, roles
    print(f"closed pipe: every process gone {took:.2f} s after head exited (seen: {roles})")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0), (signal.SIGHUP, 0)],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_while_the_models_load_stops_at_once(cluster_dir, sig, code):
    """SIGINT (Ctrl-C) to `up` while an engine loads its model (uvicorn already runs its startup, no
    engine is ready): `up` exits 130 within EXIT_S, the load is abandoned (no engine ever reports
    ready), and nothing is left. SIGTERM and SIGHUP alike, with 128 + their number."""
    data, census = cluster_dir
    # SmolLM2's real weights: a load of seconds. tiny-v4's takes less than `up`'s stop of the entrypoint
    # before the engines, so its engines could be ready by the time the signal reached them.
    up = start_up(data, free_port(), model="smollm2-135m", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = Lines(up)
    end = time.monotonic() + START_S
    while not any(r == "engine" and _catches_sigterm(p) for p, r in dict(census.seen).items()):
        assert time.monotonic() < end and up.poll() is None, lines.lines
        time.sleep(0.02)
    assert not any(ln.split()[:1] in (["prefill-0"], ["decode-0"]) and " ready" in ln for ln in lines.lines), \
        lines.lines
    t0 = time.monotonic()
    os.kill(up.pid, sig)
    assert up.wait(timeout=EXIT_S) == code, lines.lines
    exited = time.monotonic() - t0
    left, took = census.wait_gone(GONE_S)
    assert not left, f"left behind: {left}"
    logs = {name: (data / "logs" / f"{name}.log").read_text() for name in ("prefill-0", "decode-0")}
    assert not any(" ready at " in text for text in logs.values()), logs
    print(f"{sig.name} mid-load: up exited {code} in {exited:.2f} s; everything gone in {exited + took:.2f} s")


def _stream(port: int, outcome: dict, started: threading.Event) -> None:
    """A long streaming completion (ignore_eos, 60,000 tokens); `outcome` says how it ended: "finished"
    (a chunk with a finish_reason), "error" (an error chunk), "done" (`data: [DONE]`), "end" (eof, or the
    exception that ended it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny-v4", "prompt": [(7 * i) % 500 + 3 for i in range(300)], "max_tokens": 4096, "stream": True,
            "ignore_eos": True, "temperature": 0}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        outcome["status"] = r.status
        if r.status != 200:
            outcome["body"] = r.read().decode(errors="replace")
        while line := r.readline():
            if line.strip() == b"data: [DONE]":
                outcome["done"] = True
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: "):])
                outcome["chunks"] = outcome.get("chunks", 0) + 1
                started.set()
                if "error" in chunk:
                    outcome["error"] = chunk["error"]
                if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                    outcome["finished"] = chunk["choices"]
        outcome["end"] = "eof"
    except (OSError, http.client.HTTPException) as e:
        outcome["end"] = f"{type(e).__name__}: {e}"
    finally:
        outcome["at"] = time.monotonic()
        started.set()
        conn.close()


def test_ctrl_c_mid_request_exits_130_and_the_client_gets_an_error(cluster_dir):
    """A 60,000-token stream in flight through the entrypoint; SIGINT to `up`: it exits 130 within
    EXIT_S, the client's stream ends with an error event and `[DONE]` (no finish_reason), not a hang;
    nothing is left."""
    data, census = cluster_dir
    port = free_port()
    up = start_up(data, port, "--threads", "2", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = Lines(up)
    lines.wait_for("kvledger up: ready at")
    for name in ("prefill-0", "decode-0"):   # --threads reaches each engine
        log = (data / "logs" / f"{name}.log").read_text()
        assert "tiny-v4, 2 torch threads, hits read before computing) ready at" in log   # a windowed model
    outcome, started = {}, threading.Event()
    client = threading.Thread(target=_stream, args=(port, outcome, started), daemon=True)
    client.start()
    assert started.wait(120) and outcome.get("chunks"), outcome
    time.sleep(1.0)   # decoding, well inside the 60,000 tokens
    assert "at" not in outcome, outcome
    t0 = time.monotonic()
    os.kill(up.pid, signal.SIGINT)
    assert up.wait(timeout=EXIT_S) == 130, lines.lines
    exited = time.monotonic() - t0
    client.join(timeout=10)
    assert not client.is_alive(), "the client hangs"
    # ended by the server, not cut: an error event, then [DONE] (the entrypoint gets the Ctrl-C as a Ctrl-C)
    assert "finished" not in outcome and outcome.get("error", {}).get("code") == "server_shutting_down", outcome
    assert outcome.get("done"), outcome
    left, took = census.wait_gone(GONE_S)
    assert not left, f"left behind: {left}"
    print(f"Ctrl-C mid-request: client cut after {outcome['at'] - t0:.2f} s ({outcome['end']}), up exited 130 in "
          f"{exited:.2f} s, everything gone in {exited + took:.2f} s")


def test_sigkill_of_up_takes_every_child_with_it(cluster_dir):
    """`up` SIGKILLed once ready (no chance to clean up): redis-server, the engines, their fetchers and
    the entrypoint notice the dead parent (PR_SET_PDEATHSIG) and exit within GONE_S."""
    data, census = cluster_dir
    up = start_up(data, free_port(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    Lines(up).wait_for("kvledger up: ready at")
    time.sleep(0.2)   # the census has seen every process
    roles = census.roles()
    assert {"up", "redis", "entrypoint"} <= set(roles) and roles.count("engine") == 2 and \
        roles.count("fetcher") == 2, roles
    t0 = time.monotonic()
    os.kill(up.pid, signal.SIGKILL)
    up.wait(timeout=10)
    left, took = census.wait_gone(GONE_S)
    assert not left, f"left behind {time.monotonic() - t0:.1f} s after the SIGKILL: {left}"
    print(f"SIGKILL of up: every child gone in {took:.2f} s ({len(census.seen) - 1} children)")


def test_a_busy_port_fails_before_anything_starts(tmp_path):
    """`up` binds the entrypoint's port first (and hands the socket down), so a taken --port is one line and
    exit 2 before Redis or an engine starts, and no port `up` picks later can collide with it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvledger", "up", "--model", "tiny-v4", "--port", str(port),
                            "--data-dir", str(tmp_path / "c")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"kvledger: error: --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert r.stdout == "" and not (tmp_path / "c" / "redis").exists()


def test_the_redis_up_starts_needs_a_password_no_command_line_shows(tmp_path):
    """Issue 20 item 1: the Redis of `kvledger up` had no password, so any local process could write the
    registry and the index. Now it has a fresh one, in a 0600 file beside its data; the children get the
    URL in their environment, so no command line (world-readable in /proc) carries it."""
    import redis

    from kvledger.entrypoint.cluster_process import ClusterProcess

    with ClusterProcess(tmp_path / "c", prefill=1, decode=0, model="tiny-v4") as c:
        conf = tmp_path / "c" / "redis" / "redis-auth.conf"
        password = conf.read_text().split()[1]
        assert conf.stat().st_mode & 0o777 == 0o600 and len(password) >= 32
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(c.members["redis"].url).ping()
        assert redis.Redis.from_url(c.redis_url).ping()
        assert not any(password.encode() in cmd for cmd in cmdlines())
        assert password not in "\n".join(c.lines)


def cmdlines() -> list[bytes]:
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):   # a process that ended meanwhile
            out.append(p.read_bytes())
    return out
