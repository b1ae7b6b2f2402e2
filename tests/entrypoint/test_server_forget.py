"""Forgetting a tenant through a real `kvledger serve` (DESIGN rule 12, issue 54 item 3): `POST /admin/forget` with
an operator key removes the tenant's blocks, snapshots, tombstones, device cache and host pool entries, miss sample
and trace lines, and counts them in its receipt; the tenant's next request is cold, another tenant's hits as before.
tiny-v4, a windowed model, so that there are snapshots to forget (and a no-store request's are never written)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvledger.core import ModelSpec, chain_keys, salted_namespace
from kvledger.entrypoint.trace_recorder import tenant_id, trace_key
from kvledger.store.snapshots import snapshot_path
from kvledger.util.serve_process import ServeProcess
from tests.support import until

MODEL = "tiny-v4"
SPEC = ModelSpec.preset(MODEL)
ACME, BETA, GAMMA, OPS = "sk-acme-0123456789", "sk-beta-0123456789", "sk-gamma-012345678", "sk-ops-01234567890"
KEYS = {ACME: "acme", BETA: "beta", GAMMA: "gamma", OPS: {"namespace": "ops", "role": "operator"}}
CAP = (700 - 134) // 128 * 128   # tiny-v4 computes its last W + K = 134 tokens: 512 of a 700-token prompt hit


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 30000, n).tolist()


PUBLIC = ids(256, 99)   # a published prefix of 2 whole blocks (the window at its end is kept too)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("forget")
    (root / "public.json").write_text(json.dumps([PUBLIC]))
    s = ServeProcess(root / "data", "--max-tokens-limit", "8", "--public-prefix", str(root / "public.json"),
                     model=MODEL, keys=KEYS)
    s.start()
    yield s
    s.stop()


def ask(server, prompt: list[int], key: str, headers: dict | None = None, **fields) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "explain_cache_miss": True, **fields}
    status, out = server.post("/v1/completions", body, {"Authorization": f"Bearer {key}", **(headers or {})})
    assert status == 200, out
    return out["usage"]


def forget(server, namespace: str, key: str = OPS, **fields) -> tuple[int, dict]:
    return server.post("/admin/forget", {"namespace": namespace, **fields}, {"Authorization": f"Bearer {key}"})


def blocks_of(server) -> dict[str, int]:
    from kvledger.store.ledger import BlockLedger, blocks_dir

    with BlockLedger.open(path=blocks_dir(server.data_dir)) as led:   # the store the server writes, read beside it
        return led.stats().per_namespace


def trace_ids(server) -> list[int | None]:
    path = server.data_dir / "trace" / "requests.jsonl"
    return [json.loads(line).get("tenant_id") for line in path.read_text().splitlines()] if path.exists() else []


def snapshots(server, prompt: list[int], namespace: str) -> list[bool]:
    """Whether a snapshot file lies at each of the prompt's rule-4 positions (512, 640) in `namespace`."""
    from kvledger.store.ledger import blocks_dir

    keys = chain_keys(np.asarray(prompt, dtype=np.uint32), SPEC, namespace)
    return [snapshot_path(blocks_dir(server.data_dir), keys[p // 128 - 1]).exists() for p in (512, 640)]


def test_forget_removes_a_tenant_everywhere_and_counts_it(server):
    p, q = ids(700, 1), ids(700, 2)
    assert ask(server, p, ACME)["prompt_tokens_details"]["cached_tokens"] == 0
    assert ask(server, p, ACME)["prompt_tokens_details"]["cached_tokens"] == CAP   # a hit (snapshot at 512)
    ask(server, p, ACME, cache_salt="s1")                                          # a salted namespace of acme's
    ask(server, q, BETA)
    salted = salted_namespace("acme", "s1")
    before = until(lambda: (b := blocks_of(server)).get("acme") == 5 and b.get(salted) == 5 and b.get("beta") == 5
                   and b, "acme's and beta's blocks")
    secret = trace_key(server.data_dir, None)                                   # the server's own, 0600
    acme_id, beta_id = tenant_id(SPEC, "acme", secret), tenant_id(SPEC, "beta", secret)
    until(lambda: trace_ids(server).count(acme_id) == 3 and beta_id in trace_ids(server), "the trace lines")
    assert snapshots(server, p, "acme") == [True, True] and snapshots(server, q, "beta") == [True, True]

    status, receipt = forget(server, "acme", hold_s=0)
    assert status == 200, receipt
    engine = receipt["engines"]["embedded"]
    assert receipt["object"] == "forget.receipt" and receipt["namespace"] == "acme" and receipt["unreached"] == []
    assert receipt["store"]["blocks"] == 10 and receipt["store"]["faults"] == 0 and receipt["held_until"] is None
    assert engine["device_blocks"] > 0 and engine["host_snapshots"] + receipt["store"]["snapshot_files"] >= 4
    assert receipt["entrypoint"] == {"sample_prompts": 3, "trace_lines": 3}
    # nothing of acme is left: no block (salted ones included), no snapshot file, no trace line
    after = blocks_of(server)
    assert set(after) == {"beta"} and after["beta"] == before["beta"]
    assert snapshots(server, p, "acme") == [False, False] and snapshots(server, p, salted) == [False, False]
    assert snapshots(server, q, "beta") == [True, True]
    assert acme_id not in trace_ids(server) and beta_id in trace_ids(server)
    # its next request is cold (not evicted, not expired, not diverged); beta still hits
    again = ask(server, p, ACME)
    assert again["prompt_tokens_details"]["cached_tokens"] == 0, again
    assert set(again["kvledger"]["miss"]["causes"]) == {"cold", "tail"}, again
    assert ask(server, q, BETA)["prompt_tokens_details"]["cached_tokens"] == CAP


def test_a_no_store_request_of_a_windowed_model_writes_no_snapshot(server):
    r, s = ids(700, 3), ids(700, 4)
    before = blocks_of(server).get("beta", 0)
    quiet = ask(server, r, BETA, headers={"Cache-Control": "no-store"})
    assert quiet["kvledger"]["stored"] is False
    ask(server, s, BETA)                                   # a normal one after it: its blocks arrive, r's never
    until(lambda: blocks_of(server).get("beta") == before + 5, "the normal request's blocks")
    assert snapshots(server, r, "beta") == [False, False] and snapshots(server, s, "beta") == [True, True]


def test_a_held_tenant_is_served_without_being_stored_until_the_hold_ends(server):
    p = ids(700, 5)
    ask(server, p, GAMMA)
    until(lambda: blocks_of(server).get("gamma") == 5, "gamma's blocks")
    status, receipt = forget(server, "gamma", hold_s=3)
    assert status == 200 and receipt["store"]["blocks"] == 5 and receipt["held_until"] > time.time()
    held = ask(server, p, GAMMA)                           # served, cold, and kept nowhere
    assert held["prompt_tokens_details"]["cached_tokens"] == 0 and held["kvledger"]["stored"] is False
    time.sleep(3.2)
    assert "stored" not in ask(server, p, GAMMA)["kvledger"]
    until(lambda: blocks_of(server).get("gamma") == 5, "gamma's blocks after the hold")


def test_forget_needs_an_operator_and_a_tenant_name(server):
    for key, status in ((ACME, 403), ("sk-wrong-0000000000", 401)):
        got, out = forget(server, "beta", key)
        assert got == status and out["error"]["type"] in ("permission_error", "authentication_error"), out
    for fields, param in (({"namespace": "acme#salt-0123"}, "namespace"), ({"namespace": ""}, "namespace"),
                          ({"namespace": "beta", "hold_s": -1}, "hold_s"), ({"namespace": "beta", "hold_s": "x"},
                                                                            "hold_s")):
        status, out = server.post("/admin/forget", fields, {"Authorization": f"Bearer {OPS}"})
        assert status == 400 and out["error"]["param"] == param, out
    assert blocks_of(server).get("beta", 0) > 0            # nothing was forgotten by a refused call


def test_forgetting_a_tenant_leaves_the_public_prefix_it_read_and_wrote(server):
    """A tenant's prompt that starts with a published prefix writes the prefix's blocks and the window at its end
    as the public namespace's (rule 12): forgetting the tenant removes its private continuation only, and another
    tenant still resumes exactly at the prefix's end (256: the public window is still there, not a fallback)."""
    mine, theirs = PUBLIC + ids(444, 7), PUBLIC + ids(444, 8)
    before = blocks_of(server).get("acme", 0)             # what the tests before left of acme's
    ask(server, mine, ACME)
    until(lambda: blocks_of(server).get("kvledger:public") == 2 and blocks_of(server).get("acme") == before + 3,
          "the public blocks and acme's private ones")
    status, receipt = forget(server, "acme", hold_s=0)
    assert status == 200 and receipt["store"]["blocks"] == before + 3, receipt
    assert blocks_of(server).get("kvledger:public") == 2 and "acme" not in blocks_of(server)
    assert ask(server, theirs, BETA)["prompt_tokens_details"]["cached_tokens"] == 256
