"""`kvledger bench mount`: the cluster mode's block ledger (Redis index + segment files) on a local folder and on
a JuiceFS volume started here, side by side in one run: CHECK, put_chain with and without fsync, the first and
a repeated read on the other client (with and without JuiceFS's client cache), and the first open of a store
that already holds many blocks.

Sides (mount_sides.py): `local` (a folder under --dir), `juicefs` (writes through mount A, reads through mount
B: two machines), `juicefs_no_cache` (reads through mount C, `--cache-size 0`). The timed blocks are a real
model's (`--model`, default SmolLM2-135M: 2,949,120 B per 128-token block); figures are wall ms, p50 and p90
over `--reps` rounds, the sides interleaved round by round (mount_figures.py). The open figures are taken at
`--open-small` and at `--open-blocks` small blocks (`--small-bytes` each, `--blocks-per-segment` per
segment): with the index naming each block's location, opening is O(1), so the two points match, no listing
is made, and the file opens per open stay the same; beside them, the seconds one pass over every segment's
metadata takes (what opening cost before). The machine's load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvledger.core import ModelSpec
from kvledger.util.output import CliError, dumps_strict, emit_json

HELP = "block ledger on a local folder vs a JuiceFS volume: CHECK, put (fsync), reads across clients, first open"
EXAMPLES = ("kvledger bench mount --json --record docs/results",
            "kvledger bench mount --open-blocks 20000 --reps 10")
DEFAULT_MODEL = "smollm2-135m"
LIMITS = {"reps": (2, 10_000), "open_reps": (1, 1000), "open_blocks": (1, 100_000_000),
          "open_small": (1, 100_000_000), "blocks_per_segment": (1, 65_536), "small_bytes": (1, 1 << 20)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="block size of the timed puts and reads from this preset")
    p.add_argument("--dir", default=None, help="where the local side, the JuiceFS objects, caches and mount points "
                   "go (a temp folder inside, removed after; default: the system's temp folder)")
    p.add_argument("--reps", type=int, default=30, help="rounds of every CHECK, put and read figure")
    p.add_argument("--open-reps", type=int, default=20, help="first opens per store size")
    p.add_argument("--open-blocks", type=int, default=1_000_000, help="small blocks in the store at the big point")
    p.add_argument("--open-small", type=int, default=1_000, help="small blocks in the store at the small point")
    p.add_argument("--blocks-per-segment", type=int, default=64, help="small blocks per put (one segment each)")
    p.add_argument("--small-bytes", type=int, default=64, help="bytes of each small block")


def check_args(args: argparse.Namespace) -> ModelSpec:
    """The model's spec; `CliError` (one line, exit 2) for bad input or a machine without FUSE."""
    try:
        spec = ModelSpec.preset(args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    for name, (low, high) in LIMITS.items():
        value = getattr(args, name)
        if not low <= value <= high:
            raise CliError(f"--{name.replace('_', '-')} is {value}, outside [{low:,}, {high:,}]")
    if args.open_small > args.open_blocks:
        raise CliError(f"--open-small ({args.open_small:,}) must not exceed --open-blocks ({args.open_blocks:,})")
    if args.dir is not None and not Path(args.dir).is_dir():
        raise CliError(f"--dir {args.dir}: no such directory")
    from kvledger.util.juicefs import fuse_unavailable

    if (why := fuse_unavailable()) is not None:
        raise CliError(f"bench mount needs a JuiceFS mount: {why}")
    return spec


def say(text: str) -> None:
    print(f"bench mount: {text}", file=sys.stderr, flush=True)


def measure(spec: ModelSpec, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    from kvledger.bench import mount_figures as mf
    from kvledger.bench.mount_sides import started

    with started(base) as sides:
        timed = mf.Timed.of(spec.block_bytes())
        say(f"{args.reps} rounds of CHECK, put and read ({spec.block_bytes():,} B blocks)")
        ms = mf.timed_figures(sides, timed, args.reps)
        populated = mf.Populated(b"\x5a" * args.small_bytes, args.blocks_per_segment)
        points = []
        for blocks in dict.fromkeys((args.open_small, args.open_blocks)):
            populated.fill(sides, blocks, say)
            say(f"{args.open_reps} first opens at {populated.blocks:,} small blocks")
            points.append(mf.open_point(sides, timed, populated, args.open_reps))
        return {"sides": sides.describe, "ms": ms, "open": _open_figures(args, points)}


def _open_figures(args: argparse.Namespace, points: list[dict[str, Any]]) -> dict[str, Any]:
    """The open points, and per side the big point's total p50 over the small point's (1.0: O(1))."""
    first, last = points[0]["ms"]["total"], points[-1]["ms"]["total"]
    return {"small_block_bytes": args.small_bytes, "blocks_per_segment": args.blocks_per_segment,
            "probe_blocks": 4, "reps": args.open_reps, "points": points,
            "total_p50_ratio": {side: round(last[side]["p50"] / first[side]["p50"], 3) for side in first}}


def run(args: argparse.Namespace) -> None:
    spec = check_args(args)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="kvledger-bench-mount-", dir=args.dir))
    try:
        figures = measure(spec, args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {"bench": "mount", "model": spec.name, "block_bytes": spec.block_bytes(), "reps": args.reps,
              **figures, "load_avg": {"before": [round(x, 2) for x in load_before],
                                      "after": [round(x, 2) for x in os.getloadavg()]},
              "wall_s": round(time.perf_counter() - t0, 1),
              "conditions": "one redis-server for kvledger's index (both sides); local reads find what was just "
                            "written in the page cache; JuiceFS objects are local files (no network)"}
    if args.out:
        _write_out(Path(args.out), result)
    if args.json:
        emit_json(result)
    else:
        print_table(result)


def _write_out(out: Path, result: dict[str, Any]) -> None:
    """mount.json, and mount.png: each timed figure's p50 per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "mount.json").write_text(dumps_strict(result, indent=1) + "\n")
    figures = list(result["ms"])
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, side in enumerate(SIDES):
        ys = [result["ms"][f].get(side, {}).get("p50", 0.0) for f in figures]
        ax.bar([x + (i - 1) * 0.27 for x in range(len(figures))], ys, 0.27, label=side)
    ax.set_xticks(range(len(figures)), figures, rotation=40, ha="right", fontsize=7)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylabel("ms (p50)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mount.png", dpi=120)
    plt.close(fig)


SIDES = ("local", "juicefs", "juicefs_no_cache")


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"block ledger: local folder vs JuiceFS ({r['model']}, {r['block_bytes']:,} B blocks, "
              f"{r['reps']} rounds), ms p50 / p90")
    t.add_column("")
    for side in SIDES:
        t.add_column(side, justify="right")
    for figure, per_side in r["ms"].items():
        t.add_row(figure, *[_cell(per_side.get(side)) for side in SIDES])
    for point in r["open"]["points"]:
        for part, per_side in point["ms"].items():
            t.add_row(f"{part} at {point['small_blocks']:,} blocks", *[_cell(per_side.get(s)) for s in SIDES])
    Console().print(t)
    load = r["load_avg"]
    print(f"load average before {load['before']}, after {load['after']}; open total p50 big/small: "
          f"{r['open']['total_p50_ratio']}")


def _cell(fig: dict[str, float] | None) -> str:
    return "-" if fig is None else f"{fig['p50']:.2f} / {fig['p90']:.2f}"
