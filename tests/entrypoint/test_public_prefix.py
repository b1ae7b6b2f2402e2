"""A published public prefix through a real `kvledger serve` (DESIGN rule 12): 64 tenants (API keys) send one
published prefix, each with a question of its own; the prefix is computed once for all of them, no tenant reads
another's private blocks, a tenant cannot publish, and what a tenant stores under any name it picks is never
public. Token ids on /v1/completions, SmolLM2, one output token each."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvledger.util.public_prefix import PublicPrefixes
from kvledger.util.serve_process import ServeProcess

B = 128
TENANTS = 64
PREFIX_BLOCKS = 3
QUESTION = 150   # tokens after the prefix: one private block and a tail
OPS = "sk-ops-000000000000"


def tenant_key(i: int) -> str:
    return f"sk-tenant-{i:04d}-0123456789"


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, size=n).tolist()


PREFIX = tokens(1, PREFIX_BLOCKS * B + 40)   # its whole blocks are public; the 40 tokens past them are not


def complete(server: ServeProcess, key: str, prompt: list[int], salt: str | None = None) -> dict:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = server.post("/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
    assert status == 200, out
    return out["usage"]


def tenants_replies(server: ServeProcess, prompts: list[list[int]], body: dict) -> list[dict]:
    """Each prompt's reply, prompt i asked with tenant i's key."""
    replies = []
    for i, prompt in enumerate(prompts):
        status, out = server.post("/v1/completions", body | {"prompt": prompt},
                                  headers={"Authorization": f"Bearer {tenant_key(i)}"})
        assert status == 200, out
        replies.append(out)
    return replies


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("public")
    (root / "public.json").write_text(json.dumps([PREFIX]))
    keys = {tenant_key(i): f"tenant-{i}" for i in range(TENANTS)} | {OPS: {"namespace": "ops", "role": "operator"}}
    s = ServeProcess(root / "data", "--public-prefix", str(root / "public.json"), keys=keys,
                     api_key=tenant_key(0)).start()
    yield s
    s.stop()


def test_64_tenants_compute_the_published_prefix_once_and_read_none_of_each_others_blocks(server):
    public = PREFIX_BLOCKS * B
    usages = [complete(server, tenant_key(i), PREFIX + tokens(100 + i, QUESTION)) for i in range(TENANTS)]
    prompt = len(PREFIX) + QUESTION
    assert usages[0]["prompt_cache_hit_tokens"] == 0   # the first tenant computes the prefix, for everyone
    assert [u["prompt_cache_hit_tokens"] for u in usages[1:]] == [public] * (TENANTS - 1)
    computed = sum(u["prompt_cache_miss_tokens"] for u in usages)
    assert computed == TENANTS * prompt - (TENANTS - 1) * public   # the public blocks once, the rest per tenant

    # The same question after the prefix from another tenant: the public blocks only, never the first one's.
    same = PREFIX + tokens(100, QUESTION)   # tenant 0's own prompt
    assert complete(server, tenant_key(1), same)["prompt_cache_hit_tokens"] == public
    assert complete(server, tenant_key(0), same)["prompt_cache_hit_tokens"] == (len(same) - 1) // B * B   # its own


def test_a_tenant_cannot_publish_and_what_it_stores_under_any_name_is_not_public(server):
    other = tokens(2, 2 * B + 30)
    tenant = {"Authorization": f"Bearer {tenant_key(5)}"}
    status, out = server.post("/admin/public-prefixes", {"add": [other]}, headers=tenant)
    assert status == 403 and out["error"]["code"] == "operator_key_required"

    for salt in (None, "kvledger:public", "public"):   # a tenant stores `other` under every name it can pick
        complete(server, tenant_key(5), other + tokens(7, 10), salt=salt)
    operator = {"Authorization": f"Bearer {OPS}"}
    status, out = server.post("/admin/public-prefixes", {"add": [other]}, headers=operator)
    assert status == 200 and {k: out["prefixes"][-1][k] for k in ("tokens", "blocks")} == {"tokens": 2 * B, "blocks": 2}
    assert complete(server, tenant_key(6), other + tokens(8, 10))["prompt_cache_hit_tokens"] == 0   # computed anew
    assert complete(server, tenant_key(7), other + tokens(9, 10))["prompt_cache_hit_tokens"] == 2 * B   # now public

    status, out = server.post("/admin/public-prefixes", {"remove": [other]}, headers=operator)
    assert status == 200 and out["withdrawn"] == 1
    status, out = server.post("/admin/public-prefixes", {"add": [[1, 2, 3]]}, headers=operator)
    assert status == 400 and "no whole block" in out["error"]["message"]


def test_the_longest_published_prefix_a_prompt_starts_with_is_its_public_part():
    p = PublicPrefixes.of([list(range(1, 300)), list(range(1, 150))], block_size=B)
    assert [x.size for x in p.prefixes] == [256, 128]
    assert p.blocks(np.arange(1, 400, dtype=np.uint32)) == 2
    assert p.blocks(np.arange(1, 200, dtype=np.uint32)) == 1
    assert p.blocks(np.arange(2, 400, dtype=np.uint32)) == 0


def test_a_windowed_model_snapshots_at_the_published_prefix_end_and_a_tenant_resumes_there_exactly(tmp_path):
    """tiny-v4 (sliding window, bit-exact): the first tenant's prefill also stores the window at the prefix's last
    block boundary (a checkpoint there), so the second tenant, whose question differs, resumes at it; every reply
    equals one no-cache engine's (rule 10)."""
    prefix = [t % 1000 for t in tokens(3, 3 * B + 40)]
    (tmp_path / "public.json").write_text(json.dumps([prefix]))
    keys = {tenant_key(i): f"tenant-{i}" for i in range(2)}
    cached = ServeProcess(tmp_path / "data", "--public-prefix", str(tmp_path / "public.json"), model="tiny-v4",
                          keys=keys).launch()
    reference = ServeProcess(tmp_path / "ref", "--no-cache", model="tiny-v4").launch()
    try:
        cached.wait_ready(), reference.wait_ready()
        prompts = [prefix + [t % 1000 for t in tokens(10 + i, 300)] for i in range(2)]   # rule 4: windows at 512, 640
        body = {"model": "tiny-v4", "max_tokens": 6, "temperature": 0}
        replies = tenants_replies(cached, prompts, body)
        assert [r["usage"]["prompt_cache_hit_tokens"] for r in replies] == [0, 3 * B]
        for prompt, reply in zip(prompts, replies):
            status, want = reference.post("/v1/completions", body | {"prompt": prompt})
            assert status == 200 and reply["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    finally:
        cached.stop(), reference.stop()


def test_through_kvledger_up_64_tenants_compute_the_prefix_once_and_replies_are_one_engines(tmp_path):
    """The same through `kvledger up` (1 prefill + 1 decode engine, tiny-v4): the entrypoint decides the public
    part once and every leg keys by it (the wire's public_blocks). 64 tenants: the first computes the prefix, the
    other 63 read its 3 blocks and window and nothing of each other's; replies equal one no-cache engine's; a
    tenant's key cannot publish."""
    from kvledger.entrypoint.cluster_process import ClusterProcess

    prefix = [t % 1000 for t in tokens(4, 3 * B + 40)]
    (tmp_path / "public.json").write_text(json.dumps([prefix]))
    keys_file = tmp_path / "keys.json"
    keys = {tenant_key(i): f"tenant-{i}" for i in range(TENANTS)} | {OPS: {"namespace": "ops", "role": "operator"}}
    keys_file.write_text(json.dumps(keys))
    keys_file.chmod(0o600)
    prompts = [prefix + [t % 1000 for t in tokens(20 + i % 2, 300)] for i in range(TENANTS)]   # two questions
    body = {"model": "tiny-v4", "max_tokens": 6, "temperature": 0}
    reference = ServeProcess(tmp_path / "ref", "--no-cache", model="tiny-v4").start()
    try:
        want = [reference.post("/v1/completions", body | {"prompt": p})[1]["choices"][0]["token_ids"]
                for p in prompts[:2]]
    finally:
        reference.stop()
    c = ClusterProcess(tmp_path / "cluster", "--public-prefix", str(tmp_path / "public.json"), "--api-keys",
                       str(keys_file), prefill=1, decode=1, model="tiny-v4").start()
    try:
        front = ServeProcess(tmp_path / "unused")
        front.port = c.port
        got = tenants_replies(front, prompts, body)
        status, out = front.post("/admin/public-prefixes", {"add": [prompts[0][:2 * B]]},
                                 headers={"Authorization": f"Bearer {tenant_key(3)}"})
        assert status == 403 and out["error"]["code"] == "operator_key_required"
    finally:
        c.stop()
    assert [g["usage"]["prompt_cache_hit_tokens"] for g in got] == [0] + [3 * B] * (TENANTS - 1)
    assert all(g["choices"][0]["token_ids"] == want[i % 2] for i, g in enumerate(got))
