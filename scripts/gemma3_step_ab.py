"""Gemma 3 270M forwards of the engine's step shapes, its products two ways interleaved: the measurement behind
models/gemma3.py's table.

    .venv/bin/python scripts/gemma3_step_ab.py [--threads 1] [--rounds 6] [--context 1100] [--json]

`fixed-rows`: every product in fixed-row GEMMs, one chunk at a time (`fixed_rows.mm`, MKL; the logits head one
row a GEMM), as the model computed before the kernel; `kernel`: every row of the step in one call of kvledger's
fixed-order product (`gemv.product`). Two sequences are prefilled to `--context` tokens (random ids, seeded);
then per round, each side in turn, the step shapes: `decode-1` (one sequence's next token), `decode-2` (both
sequences' next tokens), `decode-2+prefill-128` (both, and a third sequence's first 128 prompt tokens), and
`prefill-256` (the third's first 256 alone). Prints per side and shape the median ms of a forward over the rounds
after the first (warm-up) and the min–max.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
import statistics
import time

import torch

from kvledger.core import ModelSpec
from kvledger.engine.models import gemv
from kvledger.engine.models.base import Chunk
from kvledger.engine.models.gemma3 import load_gemma3
from kvledger.engine.models.registry import resolve

SHAPES = ("decode-1", "decode-2", "decode-2+prefill-128", "prefill-256")


def cpu_name() -> str:
    """/proc/cpuinfo's model name (the machine's architecture where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--context", type=int, default=1100)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec.preset("gemma3-270m")
    folder = resolve("gemma3-270m").weights.folder()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 261_000, (args.context,), generator=gen) for _ in range(2)]
    third = torch.randint(1000, 261_000, (256,), generator=gen)
    blocks = -(-(args.context + 4 * args.rounds * 3) // 128) + 1
    tables = [torch.arange(1 + i * blocks, 1 + (i + 1) * blocks) for i in range(3)]
    sides = {}
    for name, kernel in (("fixed-rows", False), ("kernel", True)):
        model = load_gemma3(folder, spec, torch.device("cpu"), kernel=kernel)
        model.allocate(num_blocks=3 * blocks + 1, num_slots=3)
        for i, ids in enumerate(prompts):
            model([Chunk(ids, 0, tables[i], slot=i)])
        sides[name] = {"model": model, "at": [args.context, args.context]}
    times: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for name, side in sides.items():
            for shape in SHAPES:
                at = side["at"]
                decoding = {"decode-1": 1, "decode-2": 2, "decode-2+prefill-128": 2, "prefill-256": 0}[shape]
                chunks = [Chunk(torch.tensor([5]), at[i], tables[i], slot=i) for i in range(decoding)]
                if shape.endswith("prefill-128"):
                    chunks.append(Chunk(third[:128], 0, tables[2], slot=2))
                elif shape == "prefill-256":
                    chunks.append(Chunk(third, 0, tables[2], slot=2))
                t0 = time.perf_counter()
                side["model"](chunks)
                dt = (time.perf_counter() - t0) * 1000
                for i in range(decoding):
                    at[i] += 1
                if rnd:
                    times.setdefault((name, shape), []).append(dt)
    rows = [{"side": name, "shape": shape, "median_ms": round(statistics.median(ts), 1),
             "min_ms": round(min(ts), 1), "max_ms": round(max(ts), 1)} for (name, shape), ts in times.items()]
    if args.json:
        print(json.dumps({"script": "gemma3_step_ab", "threads": args.threads, "context": args.context,
                          "rounds": args.rounds, "cpu": cpu_name(),
                          "kernel_lanes": 16 if gemv.WIDE else 8, "rows": rows}, indent=2))
        return
    for r in rows:
        print(f"{r['side']:<11} {r['shape']:<22} {r['median_ms']:>7.1f} ms  ({r['min_ms']:.1f}–{r['max_ms']:.1f})")


if __name__ == "__main__":
    main()
