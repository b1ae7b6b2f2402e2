"""`kvledger up` keeps its cluster whole without a person (issue 23 item 6): a SIGKILLed engine, entrypoint or
Redis is started again by `up` itself, the engines come back into the registry, the entrypoint's /metrics
counts the engine's restart, and requests keep being answered as before, on the same port."""

from __future__ import annotations

import json
import signal
import time

from kvledger.bench.cluster_process import ClusterProcess
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
