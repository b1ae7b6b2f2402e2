"""Live miss attribution through `kvledger serve` (issue 24): each cause produced, in the counters
(`kvledger_prompt_miss_tokens_total`), in the request's own usage (asked for with `explain_cache_miss`) and at
`/v1/cache/misses`, where a tenant sees only its own prompts, spans and counts."""

from __future__ import annotations

import numpy as np

from kvledger.core import ModelSpec, chain_keys
from tests.engine.helpers import flip_byte_of_block
from tests.entrypoint.conftest import ALPHA, BETA, OPERATOR, OPS
from tests.entrypoint.page_dom import page_misses
from tests.entrypoint.metrics_text import metric

MODEL = "smollm2-135m"
SPEC = ModelSpec.preset(MODEL)
B = SPEC.block_size


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def ask(server, prompt, key: str = ALPHA, explain: bool = True) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if explain:
        body["explain_cache_miss"] = True
    status, out = server.post("/v1/completions", body, {"Authorization": f"Bearer {key}"})
    assert status == 200, out
    return out["usage"]


def misses(server, key: str) -> list[dict]:
    status, out = server.get("/v1/cache/misses", {"Authorization": f"Bearer {key}"})
    assert status == 200
    import json

    return json.loads(out)["data"]


def counter(server, **labels: str) -> float:
    return metric(server.get("/metrics", OPERATOR)[1].decode(), "kvledger_prompt_miss_tokens_total", **labels)


def test_cold_diverged_and_tail_with_their_counts_and_sites(open_server, tmp_path):
    server = open_server
    a = ids(300, 1)                               # 2 blocks under the cap (256), a tail of 44
    cold_before = counter(server, namespace="alpha", cause="cold")
    first = ask(server, a)
    assert first["kvledger"]["miss"] == {"causes": {"cold": 256, "tail": 44}}
    assert counter(server, namespace="alpha", cause="cold") - cold_before == 256
    b = list(a)
    b[150:153] = [7, 8, 9]                        # three tokens vary inside block 1
    second = ask(server, b)
    miss = second["kvledger"]["miss"]
    assert second["prompt_tokens_details"]["cached_tokens"] == 128
    assert miss["causes"] == {"diverged": 128, "tail": 44}
    assert miss["divergence"]["position"] == 150 and miss["divergence"]["blocks_won_if_moved_to_end"] == 1
    assert miss["divergence"]["blocks_lost"] == 1
    # not asked: the usage is what it always was
    assert "miss" not in ask(server, ids(200, 2), explain=False)["kvledger"]
    (alpha,) = misses(server, ALPHA)
    assert alpha["namespace"] == "alpha" and alpha["miss_tokens"]["diverged"] >= 128
    assert any(s["position"] == 150 and s["tokens_lost"] >= 128 for s in alpha["top_divergences"])
    # another tenant sees its own figures only: none of alpha's spans or counts
    ask(server, ids(260, 3), key=BETA)
    beta = misses(server, BETA)
    assert [t["namespace"] for t in beta] == ["beta"] and beta[0]["top_divergences"] == []
    assert "alpha" not in str(beta)
    # the operator sees both, and so does the page
    assert {"alpha", "beta"} <= {t["namespace"] for t in misses(server, OPS)}
    table, _ = page_misses(server.url, tmp_path / "profile", OPS)
    ours = next(t for t in misses(server, OPS) if t["namespace"] == "alpha")["miss_tokens"]
    assert {c: n for c, n in table["alpha"].items() if n} == ours and ours["cold"] and ours["diverged"] and ours["tail"]


def test_a_text_prompt_shows_the_varying_span_as_text(open_server):
    server = open_server
    a = "Report of 10:21:04Z. " + "The quarterly numbers follow, one line per shop. " * 20
    ask(server, a)
    miss = ask(server, a.replace("10:21:04Z", "10:25:37Z"))["kvledger"]["miss"]
    div = miss["divergence"]
    assert "5:37" in div["ours"] and "1:04" in div["theirs"], div
    assert set(miss["causes"]) == {"diverged", "tail"}


def test_a_block_that_fails_to_load_is_load_failed(shared_server, tmp_path):
    """After a restart (empty device cache), a block the CHECK promises fails its checksum when fetched."""
    server = shared_server.server
    a = ids(300, 5)
    ask(server, a)
    server = shared_server.restart()
    keys = chain_keys(np.asarray(a, dtype=np.uint32), SPEC, "alpha")
    flip_byte_of_block(server.data_dir / "blocks", keys[1])
    usage = ask(server, a)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128
    assert usage["kvledger"]["miss"]["causes"] == {"load_failed": 128, "tail": 44}
    assert counter(server, namespace="alpha", cause="load_failed") == 128
    table, bars = page_misses(server.url, tmp_path / "profile", OPS)
    assert table["alpha"]["load_failed"] == 128 and ("load_failed", 128) in bars


def _filler(server, n: int, seed: int) -> None:
    """Requests of other prompts, so the engine's device prefix cache (at its smallest) lets the first go."""
    for i in range(n):
        ask(server, ids(300, seed + i), explain=False)


def test_an_expired_block_and_an_evicted_one_are_named_by_their_tombstones(tmp_path):
    """A 3 s TTL: P's blocks expire, and once the device cache has let them go too, P again misses them as
    `expired`. A store of 4 blocks: P's blocks are evicted by the next prompts' puts, then `evicted`."""
    from kvledger.util.serve_process import ServeProcess

    small = ("--kv-cache-bytes", "1", "--max-prompt-tokens", "320", "--max-tokens-limit", "8")
    server = ServeProcess(tmp_path / "ttl", *small, "--ttl-classes", "3s", "--gc-interval-s", "0.5").start()
    try:
        p = ids(300, 40)
        assert ask(server, p, explain=False)["prompt_tokens_details"]["cached_tokens"] == 0
        import time

        time.sleep(3.5)
        _filler(server, 3, 50)
        usage = ask(server, p)
        assert usage["kvledger"]["miss"]["causes"] == {"expired": 256, "tail": 44}, usage
        assert counter(server, namespace="default", cause="expired") == 256
        table, bars = page_misses(server.url, tmp_path / "profile-ttl")
        assert table["default"]["expired"] == 256 and ("expired", 256) in bars
    finally:
        server.stop()
    server = ServeProcess(tmp_path / "capacity", *small, "--store-capacity", str(4 * SPEC.block_bytes())).start()
    try:
        p = ids(300, 60)
        ask(server, p, explain=False)
        _filler(server, 3, 70)                    # 6 more blocks into a store of 4: P's, least recently hit, go
        usage = ask(server, p)
        assert usage["kvledger"]["miss"]["causes"] == {"evicted": 256, "tail": 44}, usage
        assert counter(server, namespace="default", cause="evicted") == 256
        table, bars = page_misses(server.url, tmp_path / "profile-capacity")
        assert table["default"]["evicted"] == 256 and ("evicted", 256) in bars
    finally:
        server.stop()
