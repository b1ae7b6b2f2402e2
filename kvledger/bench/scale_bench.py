"""`kvledger bench scale`: the block ledger at node scale, the persisted index beside a rebuilt one.

For each design a store of N small blocks is built once under `--dir` (kept and reused by later
runs with the same N), then, each in fresh processes (scale_roles.py):

    open_s        opening the store ("old": with its index rebuilt from every segment's metadata)
    rss_bytes     resident memory of that process after the CHECKs and puts below (VmRSS; rss_anon_bytes and
                  rss_file_bytes split it: its own memory, and mapped files: libraries, index pages); "old":
                  of the rebuilding process, after the rebuild
    check_ms_1m   median CHECK of a 1M-token prompt (8,192 keys), all present; its hashing, the same for
                  both designs, is reported apart (hash_ms_1m)
    put_p99_ms    p99 of puts of 64 blocks while another process writes, fsync off (the index's cost);
                  put_p99_ms_fsync with fsync on in both processes, beside the disk's floor fsync_p99_ms
    put_floor_p99_ms  the floor beside it: right after each put, the CPU time that put used (put_cpu_ms is
                  the median) is burnt in a plain loop, and this is the p99 of those loops' wall time: what
                  work of a put's CPU takes on this machine at this load with no lock, I/O or page fault
    gc_s          one gc() removing `--gc-blocks` expired blocks (written just before, 1-second TTL)
    gc_idle_s     one gc() with nothing expired
    max_stall_ms  the longest put or CHECK (128K tokens) of another process during that gc(); beside it that
                  process's put p99 and the major page faults (index pages read from disk) of its slowest put;
                  stall_slowest says where the slowest op's time went: its own CPU, its voluntary and
                  involuntary switches, its page faults, the system's I/O and CPU pressure (scale_roles.OpCost)

`--burners N` runs N processes spinning on the CPU while each design is measured (after `--warm-load-s` of
them alone, so the machine is at that load and not climbing to it); `load_1m` is the 1-minute load average
sampled every second meanwhile (min, median, max). A fraction is one more process spinning that share of the
time (`util/cpu_load.burning`). With the probe and the writer, `--burners 2` read as a load of 3.6 on two
cores and `--burners 3` as 4.7; issue 25's "at load 4" is about `--burners 2.4`.

Before measuring, the index file is read once (`--cold`: not), so the page cache holds it as it
would on a serving node with the memory for it; `index_cached_before` / `index_cached` are the
shares of its pages cached before and after that read (this machine's page cache loses cold pages
to other sessions), `index_cached_after` the share after GC. With `--pin-index` the bench's own
process pins the index in memory after that read (store/index_pin.py, as `kvledger serve` does):
`pin_mode` says how ("locked", or "mapped" where mlock is refused), `pin_s` how long it took. The
roles before GC write with fsync off; their dirty pages are written out (`sync`) before GC starts,
so GC's syncs carry GC's writes and the stall process's, not a backlog.

The baseline, "old", is what the previous design (the retired scan index, rebuilt in memory at
every open) and the migration from it pay: a store written in the previous layout (segment files,
no index), its index dropped and rebuilt from every segment's metadata at open (`open_s`,
`rss_bytes` of that process); its other figures are the LMDB store's on those migrated files. It is
measured up to `--old-blocks` (default 1M); its figures sit under "old" with its own block count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kvledger.store.index_pin import IndexPin, cached_share
from kvledger.store.lmdb_index import data_file
from kvledger.util.cpu_load import LoadSampler, burning
from kvledger.util.output import CliError, emit_json

HELP = "block ledger at node scale: persisted LMDB index vs the index rebuilt from the segments (migration)"
EXAMPLES = ("kvledger bench scale --blocks 100000 --old-blocks 0 --json",)  # `--help`'s epilog
ROLE = [sys.executable, "-m", "kvledger.bench.scale_roles"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the store (new design)")
    p.add_argument("--old-blocks", type=int, default=1_000_000, help="cap for the previous design (0: skip it)")
    p.add_argument("--dir", default="/tmp/kvledger-scale", help="where the stores are built and kept")
    p.add_argument("--block-bytes", type=int, default=16, help="bytes per block (small: the index is measured)")
    p.add_argument("--per-put", type=int, default=64, help="blocks per put")
    p.add_argument("--check-reps", type=int, default=21, help="CHECKs of the 1M-token prompt")
    p.add_argument("--puts", type=int, default=300, help="puts timed for put_p99_ms")
    p.add_argument("--gc-blocks", type=int, default=None, help="expired blocks one gc() removes (default N/20)")
    p.add_argument("--gc-batch", type=int, default=4096, help="blocks per GC batch (the LMDB store caps it)")
    p.add_argument("--cold", action="store_true", help="measure without reading the index into the page cache first")
    p.add_argument("--burners", type=float, default=0, help="processes spinning on the CPU while each design is "
                   "measured (not built), a fraction one more spinning that share of the time: the load the figures "
                   "are taken under; `load_1m` reports it")
    p.add_argument("--pin-index", action="store_true", help="keep the index in memory while measuring, as "
                   "`kvledger serve` does (store/index_pin.py): the bench's own process holds the pin")
    p.add_argument("--warm-load-s", type=float, default=60.0, help="with --burners, seconds the burners run "
                   "before measuring, so the machine is at that load, not climbing to it")


def _role(name: str, args: dict, timeout_s: float = 3600) -> dict:
    out = subprocess.run([*ROLE, name, json.dumps(args)], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise CliError(f"bench scale: role {name} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _start(name: str, args: dict) -> subprocess.Popen:
    p = subprocess.Popen([*ROLE, name, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline() if p.stdout else ""
    if not line.startswith('{"ready"'):
        p.kill()
        raise CliError(f"bench scale: role {name} did not start: {p.stderr.read()[-2000:] if p.stderr else ''}")
    return p


def _finish(p: subprocess.Popen, stop: Path) -> dict:
    stop.touch()
    out, err = p.communicate(timeout=600)
    if p.returncode != 0:
        raise CliError(f"bench scale: background role failed: {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _ensure_built(design: str, root: Path, base: dict, blocks: int) -> dict:
    """Build the store unless a finished build of this size is there (marker file)."""
    marker = root / "BUILT.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if done.get("blocks") == blocks and done.get("block_bytes") == base["block_bytes"]:
            return done | {"reused": True}
    if root.exists():
        import shutil

        shutil.rmtree(root)
    res = _role("build", base | {"design": design, "root": str(root), "blocks": blocks}, timeout_s=7200)
    res |= {"block_bytes": base["block_bytes"], "built_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    marker.write_text(json.dumps(res))
    return res | {"reused": False}


def measure(design: str, root: Path, base: dict, gc_blocks: int, warm: bool, pin: bool = False) -> dict[str, Any]:
    """Every figure of one design on its built store (fresh processes); `pin`: with the index pinned in memory by
    this process (IndexPin) from after the warm read to the end."""
    a = base | {"design": design, "root": str(root)}
    rebuild = _role("rebuild", a) if design == "old" else {}   # the baseline's open (then an LMDB store)
    probe: dict[str, Any] = _role("warm", a) if warm and design == "new" else {}
    data = data_file(root)
    with IndexPin(str(data)) if pin else nullcontext() as held:
        if held is not None:
            t = time.perf_counter()
            held.start().wait()
            probe |= {"pin_s": time.perf_counter() - t, "pin_mode": held.mode}
        figures = _measure(design, root, a, gc_blocks, probe)
    return rebuild | figures | {"index_cached_after": cached_share(data)}


def _measure(design: str, root: Path, a: dict, gc_blocks: int, probe: dict[str, Any]) -> dict[str, Any]:
    stop = root.parent / f".stop-{design}-{os.getpid()}"
    stop.unlink(missing_ok=True)
    for fsync in (False, True):
        writer = _start("writer", a | {"stop": str(stop), "fsync": fsync})
        try:
            probe |= _role("probe", a | {"fsync": fsync})
        finally:
            probe[f"writer_puts{'_fsync' if fsync else ''}"] = _finish(writer, stop)["puts"]
        stop.unlink(missing_ok=True)
    victims = _role("victims", a | {"blocks": gc_blocks})
    os.sync()        # the fsync-off roles' dirty pages: not GC's to write
    time.sleep(1.5)  # the victims' 1-second TTL runs out
    stall = _start("stall", a | {"stop": str(stop)})
    try:
        time.sleep(0.5)
        gc = _role("gc", a | {"batch": a["gc_batch"]})
        time.sleep(0.2)
    finally:
        stalled = _finish(stall, stop)
    stop.unlink(missing_ok=True)
    return probe | gc | victims | {"stall_ops": stalled["ops"],
                                   "max_stall_ms": max(stalled["max_put_ms"], stalled["max_check_ms"]),
                                   "max_stall_put_ms": stalled["max_put_ms"],
                                   "max_stall_check_ms": stalled["max_check_ms"],
                                   "stall_put_p99_ms": stalled.get("put_p99_ms"),
                                   "max_stall_put_major_faults": stalled.get("max_put_major_faults"),
                                   "stall_slowest": stalled.get("slowest")}


def run(args: argparse.Namespace) -> int:
    if args.blocks < 8192 or args.per_put < 1 or args.block_bytes < 1:
        raise CliError("--blocks must be ≥ 8192 (the 1M-token prompt), --per-put and --block-bytes ≥ 1")
    if not 0 <= args.burners <= 64 or args.warm_load_s < 0:   # not NaN, not infinite
        raise CliError("--burners must lie in [0, 64] and --warm-load-s be ≥ 0")
    base = {"block_bytes": args.block_bytes, "per_put": args.per_put, "check_reps": args.check_reps,
            "puts": args.puts, "gc_batch": args.gc_batch}
    top = Path(args.dir)
    top.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"blocks": args.blocks, "block_bytes": args.block_bytes, "per_put": args.per_put,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result |= _role("fsync", base | {"root": str(top)})
    old_n = min(args.old_blocks, args.blocks)
    for design, n in (("new", args.blocks), ("old", old_n)):
        if n < 8192:
            continue
        root = top / f"{design}-{n}"
        built = _ensure_built(design, root, base, n)
        gc_blocks = args.gc_blocks if args.gc_blocks is not None else max(n // 20, 8192)
        with burning(args.burners):
            time.sleep(args.warm_load_s if args.burners else 0)
            with LoadSampler() as load:
                figures = measure(design, root, base, gc_blocks, warm=not args.cold, pin=args.pin_index)
        figures |= {"blocks": n, "build_s": built["build_s"], "build_reused": built["reused"],
                    "burners": args.burners, "load_1m": load.summary()}
        if design == "new":
            result |= figures
        else:
            result["old"] = figures
    emit = getattr(args, "json", False)
    if emit:
        emit_json(result)
    else:
        _print_table(result)
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scale.json").write_text(json.dumps(result, indent=2))
    return 0


KEYS = ("open_s", "rss_bytes", "check_ms_1m", "hash_ms_1m", "put_p99_ms", "put_floor_p99_ms", "put_cpu_ms",
        "put_p99_ms_fsync", "gc_s", "gc_idle_s", "max_stall_ms")


def _print_table(r: dict) -> None:
    old = r.get("old", {})
    print(f"{'':16} {'new (' + str(r['blocks']) + ')':>18} {'old (' + str(old.get('blocks', '-')) + ')':>18}")
    for k in KEYS:
        print(f"{k:16} {r.get(k, float('nan')):18.4g} {old.get(k, float('nan')):18.4g}")
