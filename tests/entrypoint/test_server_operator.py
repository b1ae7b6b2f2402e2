"""The operator endpoints (`/metrics`, `/dashboard/*`) name every namespace and list every tenant's last
requests: with a key file only an operator key reads them (401 without a key, 403 with a tenant's);
an open server (no key file, loopback only) keeps them open. The app in-process, without an engine."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from kvledger.entrypoint.server import build_app
from kvledger.entrypoint.server_state import ServeConfig, ServerState

ALPHA, OPS = "sk-alpha-0123456789", "sk-ops-5555555555"
GETS = ("/metrics", "/dashboard/activity")
DIFF = {"a": [1, 2, 3], "b": [1, 2, 4]}


@pytest.fixture
def serve_app(tmp_path):
    """`make(keys)` → a TestClient of `kvledger serve --model tiny-v4` with that key file (None: open)."""
    states = []

    def make(keys: dict | None) -> TestClient:
        path = None
        if keys is not None:
            path = tmp_path / f"keys-{len(states)}.json"
            path.write_text(json.dumps(keys))
            path.chmod(0o600)   # a key file others may read is refused
        state = ServerState(ServeConfig(model="tiny-v4", data_dir=tmp_path / f"data-{len(states)}", api_keys=path))
        state.vocab_size = 1000   # what the engine's load would say
        states.append(state)
        return TestClient(build_app(state.config, state))   # no lifespan: no engine, no model load

    yield make
    for state in states:
        state.close()


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_tenant_keys_get_403_and_no_key_401(serve_app):
    client = serve_app({ALPHA: "alpha"})
    for path in GETS:
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = client.get(path, headers=_bearer(ALPHA))
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "permission_error",
                                     "param": None, "code": "operator_key_required"}
    assert client.post("/dashboard/diff", json=DIFF, headers=_bearer(ALPHA)).status_code == 403
    assert client.post("/dashboard/diff", json=DIFF).status_code == 401
    assert client.get("/v1/models", headers=_bearer(ALPHA)).status_code == 200   # its own endpoints still work


def test_an_operator_key_reads_them_and_is_a_tenant_too(serve_app):
    client = serve_app({ALPHA: "alpha", OPS: {"namespace": "ops", "role": "operator"}})
    for path in GETS:
        assert client.get(path, headers=_bearer(OPS)).status_code == 200, path
    assert "kvledger_requests" in client.get("/metrics", headers=_bearer(OPS)).text
    r = client.post("/dashboard/diff", json=DIFF, headers=_bearer(OPS))
    assert r.status_code == 200 and r.json()["first_divergence"] == 2
    assert client.get("/v1/models", headers=_bearer(OPS)).status_code == 200


def test_an_open_server_keeps_them_open(serve_app):
    client = serve_app(None)
    for path in GETS:
        assert client.get(path).status_code == 200, path
    assert client.post("/dashboard/diff", json=DIFF).status_code == 200
