"""No-store and forget through `kvledger up` (DESIGN rule 12, issue 54 item 3): tiny-v4, one prefill and one decode
engine, Redis index and segment files on the cluster's folder. A no-store request runs as one whole leg and leaves
nothing in Redis; `POST /admin/forget` reaches both engines (their device caches and host pools), the Redis index,
the files and the entrypoint's trace, and its receipt names each."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.core import ModelSpec
from kvledger.entrypoint.trace_recorder import tenant_id, trace_key
from kvledger.util.serve_process import request
from tests.support import until

MODEL = "tiny-v4"
SPEC = ModelSpec.preset(MODEL)
ACME, BETA, OPS = "sk-acme-0123456789", "sk-beta-0123456789", "sk-ops-01234567890"
CAP = (700 - 134) // 128 * 128


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 30000, n).tolist()


def post(url: str, path: str, body: dict, key: str, headers: dict | None = None) -> tuple[int, dict]:
    status, raw = request(url + path, json.dumps(body).encode(),
                          {"Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})})
    return status, json.loads(raw)


def ask(url: str, prompt: list[int], key: str, headers: dict | None = None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "explain_cache_miss": True}
    status, out = post(url, "/v1/completions", body, key, headers)
    assert status == 200, out
    return out["usage"]


def per_namespace(cluster: ClusterProcess, folder: str) -> tuple[dict[str, int], set[str]]:
    """(blocks per namespace in Redis, namespaces of the segment files in the cluster's `folder`: its data dir, or
    a JuiceFS mount of its volume)."""
    from kvledger.store.redis_backend import RedisStore
    from kvledger.store.shared_files import SharedFiles

    with RedisStore(cluster.redis_url, files=SharedFiles(cluster.data_dir / folder / "blocks", create=False)) as store:
        return store.stats().per_namespace, {b.namespace for b in store.files.blocks()}


@pytest.mark.parametrize("volume", ["folder", "juicefs"])
def test_no_store_and_forget_through_kvledger_up(tmp_path, volume):
    """On the cluster's folder, and on a real JuiceFS volume `up` formats and mounts (each engine on a mount of its
    own; the files are checked through a mount; skipped, saying why, where FUSE or juicefs is unavailable)."""
    from kvledger.util.juicefs import fuse_unavailable

    if volume == "juicefs" and (why := fuse_unavailable()) is not None:
        pytest.skip(why)
    store_args, folder = ((), ".") if volume == "folder" else (("--juicefs", "--juicefs-mounts", "2"), "mounts/m0")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({ACME: "acme", BETA: "beta", OPS: {"namespace": "ops", "role": "operator"}}))
    keys.chmod(0o600)
    p, q, r = ids(700, 1), ids(700, 2), ids(700, 3)
    with ClusterProcess(tmp_path / "c", "--api-keys", str(keys), *store_args, prefill=1, decode=1, model=MODEL) as c:
        quiet = ask(c.url, r, ACME, {"Cache-Control": "no-store"})
        assert quiet["kvledger"]["stored"] is False
        assert [leg["kind"] for leg in quiet["kvledger"]["legs"]] == ["whole"]   # no P/D hand-over through the store
        ask(c.url, p, ACME)
        assert ask(c.url, p, ACME)["prompt_tokens_details"]["cached_tokens"] == CAP
        ask(c.url, q, BETA)
        assert ask(c.url, q, BETA)["prompt_tokens_details"]["cached_tokens"] == CAP
        blocks, files = until(lambda: (got := per_namespace(c, folder))[0].get("acme") == 5 and got, "acme's blocks")
        assert blocks == {"acme": 5, "beta": 5} and files == {"acme", "beta"}   # r (no-store) left nothing

        status, receipt = post(c.url, "/admin/forget", {"namespace": "acme", "hold_s": 0}, OPS)
        assert status == 200, receipt
        engines = receipt["engines"]
        assert set(engines) == {"prefill-0", "decode-0"} and receipt["unreached"] == []
        assert sum(e["device_blocks"] for e in engines.values()) > 0
        assert sum(e["host_snapshots"] for e in engines.values()) > 0
        assert receipt["store"]["blocks"] == 5 and receipt["store"]["files"] >= 1
        assert receipt["entrypoint"]["trace_lines"] == 2 and receipt["entrypoint"]["sample_prompts"] == 2
        blocks, files = per_namespace(c, folder)
        assert blocks == {"beta": 5} and files == {"beta"}
        again = ask(c.url, p, ACME)
        assert again["prompt_tokens_details"]["cached_tokens"] == 0 and set(again["kvledger"]["miss"]["causes"]) == \
            {"cold", "tail"}, again
        assert ask(c.url, q, BETA)["prompt_tokens_details"]["cached_tokens"] == CAP
        secret = trace_key(c.data_dir, c.token)   # a cluster's trace key derives from its token
    lines = [json.loads(x) for x in (tmp_path / "c" / "trace" / "requests.jsonl").read_text().splitlines()]
    tenants = [x["tenant_id"] for x in lines]
    assert tenants.count(tenant_id(SPEC, "acme", secret)) == 1 and tenants.count(tenant_id(SPEC, "beta", secret)) == 3
