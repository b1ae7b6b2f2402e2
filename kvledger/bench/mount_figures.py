"""The timed operations of `kvledger bench mount`, each run on every side in one round, the order rotated round
by round (no side always goes first); every figure is wall milliseconds, summed up as p50 and p90.

    check_N            CHECK of a stored N-block chain on each side's first reader (Redis only)
    put_N_fsync        put_chain of N new blocks, fsync on; put_N_no_fsync: off; fsync_cost_N: the paired
                       difference of the two in one round
    read_first_N       the first read of the chain `put_N_fsync` wrote, on each reader (the other client)
    read_repeat_N      the same read again, same reader
    open               a store on a side's first reader that already holds `blocks` small blocks: open, its first
                       CHECK and its first read of a chain of real blocks never read before (`open_points`)

Keys are synthetic (`scale_roles.synthetic_keys`): the store is given keys, CHECK's hashing is not timed here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvledger.bench.mount_sides import Reader, Side, Sides
from kvledger.bench.scale_roles import synthetic_keys
from kvledger.bench.sim_core import percentile
from kvledger.store.shared_files import SharedFiles

SIZES = (4, 12)          # blocks per chain of the timed puts, reads and CHECKs
PROBE_BLOCKS = 4         # blocks of the chain each first open reads
TIMED_CHAINS = 10**9     # chain ids of the timed chains start here (the populated ones from 0)
Ops = dict[str, Callable[[], Any]]


def summary(ms: list[float]) -> dict[str, float]:
    """p50 and p90 (linear interpolation) of `ms`, in ms."""
    return {"p50": round(percentile(ms, 50), 3), "p90": round(percentile(ms, 90), 3)}


def run_round(ops: Ops, rnd: int, times: dict[str, list[float]]) -> None:
    """Each op once, starting at op `rnd` mod their number; its wall ms appended under its name."""
    names = list(ops)
    k = rnd % len(names)
    for name in names[k:] + names[:k]:
        t0 = time.perf_counter()
        ops[name]()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)


def by_figure(times: dict[str, list[float]]) -> dict[str, dict[str, dict[str, float]]]:
    """{"figure|side": [ms]} → {figure: {side: {p50, p90}}}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, ms in times.items():
        figure, side = name.split("|")
        out.setdefault(figure, {})[side] = summary(ms)
    return out


def expect(got: Any, want: Any, what: str) -> None:
    """A figure of an operation that did not do its work would be a lie: stop the bench instead."""
    if got != want:
        raise RuntimeError(f"{what}: got {got}, expected {want}")


# --- CHECK, put, read ----------------------------------------------------------------------------

@dataclass(slots=True)
class Timed:
    """The real blocks every timed put writes, the buffers every timed read fills (touched once before)."""

    blocks: np.ndarray   # uint8 [max(SIZES), block_bytes]
    out: np.ndarray      # same shape

    @classmethod
    def of(cls, block_bytes: int) -> Timed:
        blocks = np.random.default_rng(5).integers(0, 256, (max(SIZES), block_bytes), dtype=np.uint8)
        return cls(blocks, np.zeros_like(blocks))

    def put(self, ledger: Any, keys: list[bytes]) -> None:
        expect(ledger.put_chain(keys, list(self.blocks[:len(keys)])).written, len(keys), "put")

    def read(self, ledger: Any, keys: list[bytes]) -> None:
        expect(ledger.read_prefix(keys, list(self.out[:len(keys)])), len(keys), "read")


def chain_of(rnd: int, n: int, kind: int) -> list[bytes]:
    """The keys of round `rnd`'s n-block chain of one kind (0: fsync on, 1: off, 2: CHECK's)."""
    return synthetic_keys(TIMED_CHAINS + (rnd * 8 + kind) * 16 + n, 0, n)


def timed_figures(sides: Sides, timed: Timed, reps: int) -> dict[str, Any]:
    """CHECK, put and read figures of every side over `reps` rounds (see the module docstring)."""
    times: dict[str, list[float]] = {}
    checked = {n: chain_of(-1, n, 2) for n in SIZES}
    for side in sides.all:
        for keys in checked.values():
            timed.put(side.writer_no_fsync, keys)
    for rnd in range(reps):
        run_round({f"check_{n}|{s.name}": _check(s.readers[0], keys) for n, keys in checked.items()
                   for s in sides.all}, rnd, times)
        run_round({f"put_{n}_{'fsync' if k == 0 else 'no_fsync'}|{s.name}": _put(timed, w, chain_of(rnd, n, k))
                   for n in SIZES for s in sides.all
                   for k, w in enumerate((s.writer, s.writer_no_fsync))}, rnd, times)
        for when in ("first", "repeat"):
            run_round({f"read_{when}_{n}|{r.name}": _read(timed, r, chain_of(rnd, n, 0))
                       for n in SIZES for r in sides.readers()}, rnd, times)
    for n in SIZES:
        for s in sides.all:
            pairs = zip(times[f"put_{n}_fsync|{s.name}"], times[f"put_{n}_no_fsync|{s.name}"])
            times[f"fsync_cost_{n}|{s.name}"] = [a - b for a, b in pairs]
    return by_figure(times)


def _check(reader: Reader, keys: list[bytes]) -> Callable[[], None]:
    return lambda: expect(reader.ledger.match(keys), len(keys), f"CHECK on {reader.name}")


def _put(timed: Timed, writer: Any, keys: list[bytes]) -> Callable[[], None]:
    return lambda: timed.put(writer, keys)


def _read(timed: Timed, reader: Reader, keys: list[bytes]) -> Callable[[], None]:
    return lambda: timed.read(reader.ledger, keys)


# --- the first open of a store holding many blocks -------------------------------------------------

class FileCalls:
    """Listings (os.listdir, os.scandir: os.walk too) and file opens under `root`, counted while `root` is set:
    a `sys.addaudithook` hook, added once per process (hooks cannot be removed)."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.listings = self.opens = 0
        sys.addaudithook(self._event)

    def _event(self, event: str, args: tuple) -> None:
        if self.root is None or event not in ("os.listdir", "os.scandir", "open"):
            return
        path = args[0] if args else None
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
        if isinstance(path, str) and path.startswith(self.root):
            if event == "open":
                self.opens += 1
            else:
                self.listings += 1


_CALLS: list[FileCalls] = []


def file_calls() -> FileCalls:
    if not _CALLS:
        _CALLS.append(FileCalls())
    return _CALLS[0]


@dataclass(slots=True)
class Populated:
    """The small blocks already in both sides' stores: `chains` chains of `per_segment` blocks (one segment
    each), `probes` chains of PROBE_BLOCKS real blocks per open point."""

    small: bytes
    per_segment: int
    chains: int = 0
    probes: int = 0

    @property
    def blocks(self) -> int:
        return self.chains * self.per_segment

    def fill(self, sides: Sides, blocks: int, say: Callable[[str], None]) -> None:
        """Add chains to both sides (fsync off, interleaved) until they hold `blocks` small blocks."""
        target = -(-blocks // self.per_segment)
        start, tenth = self.chains, 1
        while self.chains < target:
            keys = synthetic_keys(self.chains, 0, self.per_segment)
            for side in sides.all:
                expect(side.writer_no_fsync.put_chain(keys, [self.small] * len(keys)).written, len(keys), "populate")
            self.chains += 1
            if self.chains - start >= tenth * (target - start) / 10:
                say(f"populated {self.blocks:,} of {target * self.per_segment:,} small blocks on both sides")
                tenth += 1

    def probe_chains(self, sides: Sides, timed: Timed, n: int) -> list[list[bytes]]:
        """n new chains of PROBE_BLOCKS real blocks on both sides, for n first opens to read once each."""
        out = []
        for _ in range(n):
            keys = synthetic_keys(-1 - self.probes, 0, PROBE_BLOCKS)
            self.probes += 1
            for side in sides.all:
                timed.put(side.writer_no_fsync, keys)
            out.append(keys)
        return out


def open_point(sides: Sides, timed: Timed, populated: Populated, reps: int) -> dict[str, Any]:
    """The first opens of a store holding `populated.blocks` blocks: each side's first reader's folder opened
    anew `reps` times, each open CHECKing and reading a probe chain it never read; beside it the baseline,
    one pass reading every segment's metadata (what opening cost before the index named locations)."""
    probes = populated.probe_chains(sides, timed, reps)
    times: dict[str, list[float]] = {}
    calls = {s.name: {"listings": 0, "file_opens": 0} for s in sides.all}
    for rnd, keys in enumerate(probes):
        run_round({f"first_open|{s.name}": _first_open(sides, s, timed, keys, times, calls[s.name])
                   for s in sides.all}, rnd, {})
    scans = {s.name: _metadata_scan(s.readers[0]) for s in sides.all}
    return {"small_blocks": populated.blocks, "segments": {k: n for k, (_, n) in scans.items()},
            "ms": by_figure(times),
            "listings": {k: v["listings"] for k, v in calls.items()},
            "file_opens_per_open": {k: v["file_opens"] / reps for k, v in calls.items()},
            "metadata_scan_s": {k: s for k, (s, _) in scans.items()}}


def _first_open(sides: Sides, side: Side, timed: Timed, keys: list[bytes], times: dict[str, list[float]],
                calls: dict[str, int]) -> Callable[[], None]:
    def run() -> None:
        counter = file_calls()
        counter.root, counter.listings, counter.opens = str(side.readers[0].root), 0, 0
        t0 = time.perf_counter()
        ledger = sides.open_reader(side.readers[0], side)
        t1 = time.perf_counter()
        expect(ledger.match(keys), len(keys), "first CHECK")
        t2 = time.perf_counter()
        timed.read(ledger, keys)
        t3 = time.perf_counter()
        counter.root = None
        ledger.close()
        calls["listings"] += counter.listings
        calls["file_opens"] += counter.opens
        for name, ms in (("open", t1 - t0), ("first_check", t2 - t1), ("first_read", t3 - t2), ("total", t3 - t0)):
            times.setdefault(f"{name}|{side.name}", []).append(ms * 1e3)
    return run


def _metadata_scan(reader: Reader) -> tuple[float, int]:
    """(seconds, segments) of listing the segments and reading every one's metadata through `reader`'s mount."""
    t0 = time.perf_counter()
    files = SharedFiles(reader.root, create=False)
    n = sum(1 for _ in files.segments())
    files.close()
    return round(time.perf_counter() - t0, 3), n
