"""A cluster records its trace at its front: `kvledger up` → the entrypoint's `--trace-dir <data-dir>/trace`, with
the engine that served each request, its ids keyed by the cluster token's trace key (the same in every entrypoint);
`up --no-trace` records nothing."""

from __future__ import annotations

import json

import numpy as np

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.core import ModelSpec, chain_keys
from kvledger.entrypoint.trace_recorder import KEY_FILE, hash_id
from kvledger.state.auth import derive_keys
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
    token = (tmp_path / "on" / "cluster.token").read_text().strip()   # every entrypoint of the cluster holds it
    keys = chain_keys(np.arange(1, 300, dtype=np.uint32), ModelSpec.preset("tiny-v4"), "default")
    assert json.loads(lines[0])["hash_ids"] == [hash_id(k, derive_keys(token).trace) for k in keys]
    assert not (tmp_path / "on" / KEY_FILE).exists()   # no key file of its own: the token's key
    assert json.loads((tmp_path / "on" / "trace" / "server.json").read_text())["mode"] == "cluster"
    assert json.loads(raw)["live"]["requests"] == 1
    with ClusterProcess(tmp_path / "off", "--no-trace", prefill=0, decode=0, both=1, model="tiny-v4") as cluster:
        _send(cluster.url)
    assert not (tmp_path / "off" / "trace").exists()
