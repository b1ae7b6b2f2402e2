"""`GET /whatif`: `kvledger whatif` on the server's own trace folder, for the operator only (a tenant's key gets 403,
no key 401); its one-line errors come back as 400, no trace as 404. The app in-process, without an engine; the
trace is written as the recorder writes it, and the what-if runs in a real child process."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from kvledger.bench.trace import LiveFigures, TraceRequest, write_trace
from kvledger.entrypoint.server import build_app
from kvledger.entrypoint.server_state import ServeConfig, ServerState

ALPHA, OPS = "sk-alpha-0123456789", "sk-ops-5555555555"
KEYS = {ALPHA: "alpha", OPS: {"namespace": "ops", "role": "operator"}}


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def app(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    keys.chmod(0o600)   # a key file others may read is refused
    state = ServerState(ServeConfig(model="tiny-v4", data_dir=tmp_path / "data", api_keys=keys))
    client = TestClient(build_app(state.config, state))   # no lifespan: no engine, no model load
    yield client, state
    state.close()


def _record(state: ServerState, n: int = 12) -> None:
    """n requests of 3 conversations, as the recorder writes them (its server.json is already there)."""
    requests = []
    for i in range(n):
        ids = tuple(range(100 * (i % 3), 100 * (i % 3) + 2 + i // 3))
        cached = 0 if i < 3 else (len(ids) - 1) * 128
        requests.append(TraceRequest(1_800_000_000.0 + i, 128 * len(ids) + 140, 2, ids, 128,
                                     live=LiveFigures(cached, 0.05 + (128 * len(ids) + 140 - cached) / 4000, None,
                                                      "snapshot" if cached else "miss", 0, None, 0.01)))
    write_trace(requests, state.config.trace_folder / "requests.jsonl")


def test_a_tenant_gets_403_no_key_401_and_the_operator_the_report(app):
    client, state = app
    _record(state)
    assert client.get("/whatif").status_code == 401
    r = client.get("/whatif", headers=_bearer(ALPHA))
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_key_required"
    r = client.get("/whatif?capacity=20K&ttl=2s&routing=round-robin&last=10", headers=_bearer(OPS))
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["requests"] == 10 and report["server"]["model"] == "tiny-v4"
    assert [row["change"] for row in report["rows"]][:3] == ["capacity", "ttl", "routing"]
    assert {"live", "as_recorded", "calibration", "rows"} <= set(report)


@pytest.mark.parametrize("query, status, code, message", [
    ("capacity=lots", 400, "invalid_value", "--capacity: expected a size"),
    ("capacity=--out=/tmp/x", 400, "invalid_value", "--capacity: expected a size"),   # a value is never a flag
    ("colour=blue", 400, "invalid_value", "unknown parameter 'colour'"),
    ("last=1&last=2", 400, "invalid_value", "more than once"),
    ("routing=nearest", 400, "invalid_value", "invalid choice"),
])
def test_bad_parameters_are_400_with_the_commands_line(app, query, status, code, message):
    client, state = app
    _record(state)
    r = client.get(f"/whatif?{query}", headers=_bearer(OPS))
    assert r.status_code == status and r.json()["error"]["code"] == code and message in r.json()["error"]["message"]


def _repeat(name: str, value: str, n: int) -> str:
    return "&".join([f"{name}={value}"] * n)


@pytest.mark.parametrize("query, param, bound", [
    ("prefill_engines=1025", "prefill_engines", "--prefill-engines must be at most 1024"),
    ("last=10000001", "last", "--last must be at most 10000000"),
    ("capacity=2000000T", "capacity", "--capacity must be at most 1e+18 bytes"),
    ("capacity=1e19", "capacity", "--capacity must be at most 1e+18 bytes"),
    ("ttl=366d", "ttl", "--ttl must be at most 365 days"),
    ("ttl=agent=1h,chatbot=400d", "ttl", "--ttl must be at most 365 days"),
    (_repeat("capacity", "1G", 9), "capacity", "--capacity: at most 8 values"),
    (_repeat("ttl", "1h", 9), "ttl", "--ttl: at most 8 values"),
    (_repeat("routing", "round-robin", 9), "routing", "--routing: at most 8 values"),
])
def test_parameters_past_their_bound_are_400_naming_it(app, query, param, bound):
    """Issue 54 item 4: `prefill_engines=100000` used 300 s of CPU and 10^8 allocated 2.8 GiB; every numeric
    parameter (and the count of a repeatable one: each value is one more simulation) now has a bound, and a
    value past it is a 400 whose error object names the parameter and the bound. Just past each bound here:
    on the code before the bounds each of these ran a what-if (200)."""
    client, state = app
    _record(state)
    r = client.get(f"/whatif?{query}", headers=_bearer(OPS))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == param and bound in error["message"], error


def test_parameters_at_their_bound_are_served(app):
    client, state = app
    _record(state)
    query = "&".join([_repeat("capacity", "1G", 7), "capacity=1e18", "ttl=365d", "routing=round-robin",
                      "prefill_engines=1024", "last=10000000"])
    r = client.get(f"/whatif?{query}", headers=_bearer(OPS))
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    assert r.json()["requests"] == 12 and [row["setting"] for row in rows if row["change"] == "routing"] == [
        "round-robin, 1024 engines, shared store"]


def test_no_trace_yet_is_404(app):
    client, _ = app
    r = client.get("/whatif", headers=_bearer(OPS))
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_trace", r.text
