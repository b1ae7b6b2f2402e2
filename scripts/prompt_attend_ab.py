"""SmolLM2 prompt forwards with a prompt chunk's attention in torch's float32 kernel over gathered K and V, and in
kvledger's float32 kernel over the blocks (the default where the CPU has AVX-512F) (`models/prompt_attend.py`):
the measurement behind prompt_attend.py's figures.

    .venv/bin/python scripts/prompt_attend_ab.py [--context 2304] [--hit 2048] [--threads 2] [--rounds 7]

Each round runs, per side, one untimed cold forward of `--context` random tokens, then a timed one, a timed hit
(the last context − hit tokens over the first `hit` already in the blocks: the chunk of a served hit) and a timed
one-token hit (every block present: the L − 1 cap). Sides: `torch` (`prompt_attend.KERNEL` off, as
`KVLEDGER_PROMPT_ATTEND=0` or a CPU without AVX-512F has it) and `kernel` (the default). Prints per side the median
seconds over the rounds and the min–max, then each hit's logits against the same side's cold ones, and the kernel's
cold logits against `torch`'s: max |difference| / max |logit|.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvledger.engine.models import prompt_attend
from kvledger.engine.models.base import Chunk
from smollm2_forward_ab import parse, smollm2_prompt

SIDES = {"torch": False, "kernel": True}   # prompt_attend.KERNEL


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    a = parse(__doc__, rounds=7)
    model, table, ids = smollm2_prompt(a)
    n = a.context
    times: dict[tuple[str, str], list[float]] = {}
    logits: dict[tuple[str, str], torch.Tensor] = {}
    kernel = prompt_attend.KERNEL
    if not kernel:
        print("kvledger's prompt kernel is off here (no AVX-512F, or KVLEDGER_PROMPT_ATTEND=0): `kernel` is `torch`")
    try:
        for _ in range(a.rounds):
            for name, use_kernel in SIDES.items():
                prompt_attend.KERNEL = kernel and use_kernel
                model([Chunk(ids, 0, table, prompt_len=n)])
                for kind, start in (("cold", 0), ("hit", a.hit), ("one", n - 1)):
                    t = time.perf_counter()
                    logits[name, kind] = model([Chunk(ids[start:], start, table, prompt_len=n)])[0]
                    times.setdefault((name, kind), []).append(time.perf_counter() - t)
    finally:
        prompt_attend.KERNEL = kernel
    for (name, kind), ts in times.items():
        print(f"{name:>7} {kind:>4}: {statistics.median(ts):.4f} s ({min(ts):.4f}–{max(ts):.4f})")
    for name in SIDES:
        print(f"{name}: hit against cold {rel(logits[name, 'hit'], logits[name, 'cold']):.1e}, "
              f"one-token hit against cold {rel(logits[name, 'one'], logits[name, 'cold']):.1e}")
    print(f"cold logits, kernel against torch: {rel(logits['kernel', 'cold'], logits['torch', 'cold']):.1e}, "
          f"same argmax: {bool(logits['kernel', 'cold'].argmax() == logits['torch', 'cold'].argmax())}")


if __name__ == "__main__":
    main()
