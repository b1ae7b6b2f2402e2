"""A cluster records its trace at its front: `kvledger up` → the entrypoint's `--trace-dir <data-dir>/trace`, with
the engine that served each request; `up --no-trace` records nothing."""

from __future__ import annotations

import json

from kvledger.bench.cluster_process import ClusterProcess
from kvledger.util.serve_process import request


def _send(url: str) -> None:
    body = {"model": "tiny-v4", "prompt": list(range(1, 300)), "max_tokens": 2, "temperature": 0}
    status, raw = request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw


def test_up_records_at_its_front_and_no_trace_turns_it_off(tmp_path):
    with ClusterProcess(tmp_path / "on", prefill=0, decode=0, both=1, model="tiny-v4") as cluster:
        _send(cluster.url)
        status, raw = request(cluster.url + "/whatif")
        assert status == 200, raw            # open cluster (loopback, no key file): the operator endpoints are open
    lines = (tmp_path / "on" / "trace" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["live"]["engine"] == "both-0"
    assert json.loads((tmp_path / "on" / "trace" / "server.json").read_text())["mode"] == "cluster"
    assert json.loads(raw)["live"]["requests"] == 1
    with ClusterProcess(tmp_path / "off", "--no-trace", prefill=0, decode=0, both=1, model="tiny-v4") as cluster:
        _send(cluster.url)
    assert not (tmp_path / "off" / "trace").exists()
