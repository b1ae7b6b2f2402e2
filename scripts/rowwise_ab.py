"""SmolLM2 forwards with a layer's row-wise operators in torch, in kvledger's kernel (`models/rowwise.py`), and made
free: the measurement behind rowwise.py's figures.

    .venv/bin/python scripts/rowwise_ab.py [--context 2304] [--hit 2048] [--threads 2] [--rounds 6]

Each round runs, per side, one untimed cold forward of `--context` random tokens, then a timed one, then a timed
hit: the last context − hit tokens over the first `hit` already in the blocks (the L − 1 cap's chunk of a served
hit). Sides: `torch` (`rowwise.AVAILABLE` off), `kernel` (on), `free` (the RMSNorm, rotation and silu · up replaced
by no-ops: wrong logits, the bound on what fusing them can save). Prints per side the median seconds over the rounds
and the min–max, then the kernel's cold logits against torch's: max |difference| / max |logit| and whether the
argmax agrees.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvledger.engine.models import llama, rowwise
from kvledger.engine.models.base import Chunk
from smollm2_forward_ab import parse, smollm2_prompt


def main() -> None:
    a = parse(__doc__, rounds=6)
    model, table, ids = smollm2_prompt(a)
    own = {"norm": llama.RMSNorm.forward, "rotate": rowwise.rotate_, "silu_mul": rowwise.silu_mul,
           "available": rowwise.AVAILABLE}

    def side(name: str) -> None:
        rowwise.AVAILABLE = own["available"] and name == "kernel"
        free = name == "free"
        llama.RMSNorm.forward = (lambda self, x, add=None: x if add is None else x.add_(add)) if free else own["norm"]
        rowwise.rotate_ = (lambda x, cos, sin: x) if free else own["rotate"]
        rowwise.silu_mul = (lambda gu: gu[:, :gu.shape[1] // 2]) if free else own["silu_mul"]

    times: dict[tuple[str, str], list[float]] = {}
    logits: dict[str, torch.Tensor] = {}
    try:
        with torch.inference_mode():
            for _ in range(a.rounds):
                for name in ("torch", "kernel", "free"):
                    side(name)
                    model([Chunk(ids, 0, table)])
                    t = time.perf_counter()
                    logits[name] = model([Chunk(ids, 0, table)])
                    times.setdefault((name, "cold"), []).append(time.perf_counter() - t)
                    t = time.perf_counter()
                    model([Chunk(ids[a.hit:], a.hit, table)])
                    times.setdefault((name, "hit"), []).append(time.perf_counter() - t)
    finally:
        side("kernel")
        rowwise.AVAILABLE = own["available"]
    for (name, kind), ts in times.items():
        print(f"{name:>6} {kind:>4}: {statistics.median(ts):.3f} s ({min(ts):.3f}–{max(ts):.3f})")
    first, second = logits["torch"], logits["kernel"]
    print(f"cold logits, kernel against torch: max |difference| / max |logit| = "
          f"{float((first - second).abs().max() / first.abs().max()):.1e}, "
          f"same argmax: {bool(first.argmax() == second.argmax())}")


if __name__ == "__main__":
    main()
