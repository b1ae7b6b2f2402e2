"""Where a vLLM CPU decode step goes: SmolLM2 in float32, the engine in this process, `torch.profiler` per step.

    .venv-vllm/bin/python scripts/vllm_decode_profile.py [--context 2304] [--rounds 3]

vLLM's offline `LLM` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` (its engine core in this process, so the profiler
sees the model's operators) on kvledger's SmolLM2 folder, as `kvledger bench serve --against vllm` starts it
(float32, blocks of 128, prefix caching, its KV space and cores). A prompt of `--context` random ids is
prefilled, then, per round, one token (the prompt is cached: a hit) and 41 tokens: TPOT is their difference
over 40, without vLLM's HTTP server. Then the prompt's 2 and 22 tokens under the profiler: each operator's self
CPU time of the 20 steps between them, per step (so the prefill of the last block, in both, cancels out).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

FOLDER = Path.home() / ".cache/kvledger/models/SmolLM2-135M-Instruct-6e414b4ba6f6be96"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", type=Path, default=FOLDER, help="the HF folder kvledger converts (default %(default)s)")
    p.add_argument("--context", type=int, default=2304)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    llm = LLM(model=str(a.folder), dtype="float32", block_size=128, enable_prefix_caching=True,
              max_model_len=a.context + 128)
    rng = random.Random(0)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randint(100, 40_000) for _ in range(a.context)]}

    def generate(p: dict, n: int) -> None:
        llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False)

    generate(prompt(), 8)   # warm-up
    for _ in range(a.rounds):
        q = prompt()
        generate(q, 1)
        t = time.perf_counter()
        generate(q, 1)
        one = time.perf_counter() - t
        t = time.perf_counter()
        generate(q, 41)
        print(f"TPOT {(time.perf_counter() - t - one) / 40 * 1e3:.1f} ms (a hit's one token {one * 1e3:.0f} ms)")

    def operators(n: int) -> dict[str, tuple[float, int]]:
        q = prompt()
        generate(q, 1)
        with profile(activities=[ProfilerActivity.CPU]) as pr:
            generate(q, n)
        return {e.key: (e.self_cpu_time_total, e.count) for e in pr.key_averages()}

    short, long = operators(2), operators(22)
    rows = sorted((((t - short.get(k, (0, 0))[0]) / 20 / 1e3, (c - short.get(k, (0, 0))[1]) / 20, k)
                   for k, (t, c) in long.items()), reverse=True)
    for ms, calls, name in rows[:12]:
        print(f"{name[:50]:50s} {ms:7.2f} ms a step {calls:6.1f} calls a step")
    print(f"{'every operator':50s} {sum(r[0] for r in rows):7.2f} ms a step")


if __name__ == "__main__":
    main()
