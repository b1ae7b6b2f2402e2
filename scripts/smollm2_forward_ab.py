"""What `rowwise_ab.py` and `prompt_attend_ab.py` share: their arguments, and SmolLM2 with a random prompt in its
blocks' table (run either script from the repository root; this file is imported, not run)."""

from __future__ import annotations

import argparse

import torch

from kvledger.engine.models.registry import resolve


def parse(doc: str, rounds: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2304)
    p.add_argument("--hit", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=rounds)
    return p.parse_args()


def smollm2_prompt(a: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """SmolLM2 on `a.threads` threads with a pool for `a.context` tokens, their block table, and `a.context` random
    token ids (seed 0)."""
    torch.set_num_threads(a.threads)
    model = resolve("smollm2-135m").load("cpu")
    n = a.context
    model.allocate(n // 128 + 3, 0)
    table = torch.arange(1, n // 128 + 3)
    return model, table, torch.randint(100, 40_000, (n,), generator=torch.Generator().manual_seed(0))
