"""No-store requests through a real `kvledger serve` (DESIGN rule 12, issue 54 item 3): a request sent with
`Cache-Control: no-store`, with `"store": false`, or by a key configured so, reads what is cached and leaves
nothing: no block in the store, no entry in the device prefix cache, no line in the trace, no prompt in the miss
sample. Its usage says `stored: false`; a normal request after it stores as before."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.entrypoint.conftest import ALPHA, QUIET
from tests.support import until

MODEL = "smollm2-135m"


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def ask(server, prompt: list[int], key: str, *, headers: dict | None = None, **fields) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "explain_cache_miss": True, **fields}
    status, out = server.post("/v1/completions", body, {"Authorization": f"Bearer {key}", **(headers or {})})
    assert status == 200, out
    return out["usage"]


def store_blocks(run_cli, server) -> dict:
    """`kvledger store stats --json` of the server's data dir, as an operator reads it while it serves."""
    got = run_cli("store", "stats", "--path", str(server.data_dir), "--json")
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def trace_lines(server) -> int:
    path = server.data_dir / "trace" / "requests.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


WAYS = {"header": (ALPHA, {"headers": {"Cache-Control": "private, No-Store"}}),
        "body": (ALPHA, {"store": False}),
        "key": (QUIET, {})}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_no_store_request_leaves_nothing_and_the_next_one_stores(open_server, run_cli, way):
    key, how = WAYS[way]
    seed = {"header": 11, "body": 12, "key": 13}[way]
    server, prompt = open_server, ids(300, seed)           # 2 blocks under the cap (full attention), a tail of 44
    before, lines = store_blocks(run_cli, server), trace_lines(server)
    quiet = ask(server, prompt, key, **how)
    assert quiet["kvledger"]["stored"] is False and quiet["prompt_tokens_details"]["cached_tokens"] == 0
    # a normal request of the same tenant: P with 3 tokens changed in block 1. Had P been sampled, its first
    # absent block would be `diverged` at 150; it is `cold`, and nothing of P was stored, on disk or device
    edited = list(prompt)
    edited[150:153] = [7, 8, 9]
    normal = ask(server, edited, key if way != "key" else ALPHA)
    assert "stored" not in normal["kvledger"]
    if way != "key":   # the same tenant as the no-store request
        assert normal["kvledger"]["miss"]["causes"] == {"cold": 256, "tail": 44}, normal
    assert normal["prompt_tokens_details"]["cached_tokens"] == 0
    # the normal request's line and blocks arrive; the no-store one's never did (the writers are in order)
    until(lambda: trace_lines(server) == lines + 1, "the normal request's trace line")
    after = until(lambda: (s := store_blocks(run_cli, server))["blocks"] == before["blocks"] + 2 and s,
                  "the normal request's 2 blocks")
    assert after["snapshots"] == before["snapshots"]
    time.sleep(0.5)
    assert trace_lines(server) == lines + 1 and store_blocks(run_cli, server)["blocks"] == before["blocks"] + 2
    # the identical no-store prompt again: its block 1 was never kept anywhere (neither in the store nor on the
    # device); its block 0 is the edited prompt's, stored since when that one was the same tenant's
    again = ask(server, prompt, key, **how)
    shared = 128 if way != "key" else 0
    assert again["prompt_tokens_details"]["cached_tokens"] == shared and again["kvledger"]["stored"] is False


def test_a_no_store_request_reads_what_is_cached(open_server):
    prompt = ids(300, 14)
    ask(open_server, prompt, ALPHA)                        # stored, by a normal request
    hit = ask(open_server, prompt, ALPHA, headers={"Cache-Control": "no-store"})
    assert hit["prompt_tokens_details"]["cached_tokens"] == 256 and hit["kvledger"]["stored"] is False


def test_store_true_and_other_directives_store(open_server):
    prompt = ids(300, 15)
    first = ask(open_server, prompt, ALPHA, store=True, headers={"Cache-Control": "no-cache, max-age=0"})
    assert "stored" not in first["kvledger"]
    assert ask(open_server, prompt, ALPHA)["prompt_tokens_details"]["cached_tokens"] == 256


def test_store_must_be_a_boolean(open_server):
    status, out = open_server.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "store": "no"})
    assert status == 400 and out["error"]["param"] == "store", out
