"""`kvledger up` keeps its cluster whole without a person (issue 23 items 6 and 7): a SIGKILLed engine, entrypoint
or Redis is started again by `up` itself, the engines come back into the registry, the entrypoint's /metrics
counts the engine's restart, and requests keep being answered as before, on the same port; a SIGSTOPped
engine leaves routing within the registry's TTL and its stream is continued elsewhere within the leg
deadline, not after the stop."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.engine.engine_registry import DEFAULT_TTL_S
from kvledger.entrypoint.remote import LEG_IDLE_S
from kvledger.util.serve_process import request

from .test_reference_check import metric

BACK_S = 120.0   # a restarted engine loads its model again: seconds on a loaded 2-core machine


def complete(url: str, tokens: list[int]) -> tuple[int, dict]:
    body = {"model": "tiny-v4", "prompt": tokens, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, raw = request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw or b"{}")


def wait_line(cluster: ClusterProcess, *parts: str, after: int = 0) -> str:
    """The first status line from index `after` on that contains every one of `parts`."""
    deadline = time.monotonic() + BACK_S
    while time.monotonic() < deadline:
        for line in cluster.lines[after:]:
            if all(p in line for p in parts):
                return line
        time.sleep(0.1)
    raise AssertionError(f"no line with {parts} in {BACK_S} s: {cluster.lines[after:]}")


def test_up_restarts_a_killed_engine_entrypoint_and_redis(tmp_path):
    prompt = list(range(100, 500))
    with ClusterProcess(tmp_path / "data", prefill=1, decode=1, model="tiny-v4") as cluster:
        status, first = complete(cluster.url, prompt)
        assert status == 200

        # an engine: started again after its backoff, back in the registry under a new pid, counted
        mark = len(cluster.lines)
        old = cluster.members["decode-0"].pid
        cluster.signal("decode-0", signal.SIGKILL)
        assert "restarting in 1 s" in wait_line(cluster, "decode-0", "exited with -9", after=mark)
        wait_line(cluster, "decode-0", "ready at", "(restart 1)", after=mark)
        assert cluster.members["decode-0"].pid != old
        deadline = time.monotonic() + 30   # the entrypoint lists the registry every 0.5 s
        while metric(cluster.url, "kvledger_engine_restarts_total", engine="decode-0") < 1:
            assert time.monotonic() < deadline, "the entrypoint never counted decode-0's restart"
            time.sleep(0.2)
        status, again = complete(cluster.url, prompt)
        assert status == 200 and again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert [leg["kind"] for leg in again["usage"]["kvledger"]["legs"]] == ["prefill", "decode"]

        # Redis: started again on its port and data; the heartbeats fill the registry again
        mark = len(cluster.lines)
        cluster.signal("redis", signal.SIGKILL)
        wait_line(cluster, "redis", "ready again at", after=mark)
        deadline = time.monotonic() + 30
        while json.loads(request(cluster.url + "/health")[1] or b"{}").get("engines", 0) < 2:
            assert time.monotonic() < deadline, "the engines never came back into the registry"
            time.sleep(0.2)
        assert complete(cluster.url, prompt)[0] == 200

        # the entrypoint: started again on the same port (`up` holds the socket meanwhile)
        mark = len(cluster.lines)
        cluster.signal("entrypoint", signal.SIGKILL)
        wait_line(cluster, "entrypoint", "ready at", "(restart 1)", after=mark)
        status, last = complete(cluster.url, prompt)
        assert status == 200 and last["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def engines_listed(url: str) -> int:
    return int(json.loads(request(url + "/health")[1] or b"{}").get("engines", 0))


def test_a_frozen_decode_engine_costs_its_stream_the_leg_deadline_not_the_stop(tmp_path):
    """SIGSTOP of the decode engine while it streams a reply, for 15 s: the entrypoint's leg sees no keepalive for
    LEG_IDLE_S and continues the request on the prefill engine; the registry drops the frozen engine within
    its TTL (+ a listing); after SIGCONT it is back. The reply's one pause is the leg deadline (plus the
    continuation's prefill), and it completes long before the stop ends."""
    stop_s = 15.0
    with ClusterProcess(tmp_path / "data", prefill=1, decode=1, model="tiny-v4") as cluster:
        port = int(cluster.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "tiny-v4", "prompt": list(range(100, 400)), "max_tokens": 60, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        frozen = cluster.members["decode-0"].pid
        tokens, usage, stopped_at, arrivals, dropped = 0, None, None, [], []

        def watch() -> None:   # when the entrypoint stops listing the frozen engine
            while time.monotonic() - stopped_at < stop_s - 1:
                if engines_listed(cluster.url) == 1:
                    dropped.append(time.monotonic() - stopped_at)
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        try:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if not chunk["choices"]:
                    continue
                tokens += 1   # a chunk per token
                if stopped_at is not None:
                    arrivals.append(time.monotonic() - stopped_at)
                if tokens == 3:   # the decode leg streams: freeze it, and watch the registry from then on
                    os.kill(frozen, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                    watcher.start()
            done_s = time.monotonic() - stopped_at
            watcher.join(stop_s)
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert usage is not None and usage["completion_tokens"] == 60
        kinds = [leg["kind"] for leg in usage["kvledger"]["legs"]]
        assert kinds == ["prefill", "decode", "continue"], kinds
        pause = max(b - a for a, b in zip([0.0, *arrivals], arrivals))
        assert LEG_IDLE_S - 0.5 < pause < LEG_IDLE_S + 4, (pause, arrivals[:8])
        assert done_s < stop_s - 3, f"the reply waited out the stop: {done_s:.1f} s"
        assert dropped and dropped[0] < DEFAULT_TTL_S + 1.0, dropped   # its TTL, + up to a beat and a listing
        deadline = time.monotonic() + 30
        while engines_listed(cluster.url) < 2:   # back after SIGCONT, by its own heartbeat
            assert time.monotonic() < deadline
            time.sleep(0.2)
