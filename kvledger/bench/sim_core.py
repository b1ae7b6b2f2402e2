"""A discrete-event model of a kvledger cluster, driven by requests (a trace or a workload).

Model (units: seconds, tokens, bytes):
- N prefill engines, each a FIFO server doing one request at a time: service = fetch + compute,
  no overlap (the first-order model of `kvledger plan`). fetch = latency + bytes / bandwidth for
  the reused blocks (and the snapshot when it comes from storage or another machine);
  compute = (prompt − recompute_from) / prefill throughput. TTFT = queueing + service.
- M decode engines: each request decodes at `decode_tps` tokens/s on the engine with the fewest
  active requests (unbounded batch). At its end the output's full blocks and the decode snapshot
  are stored (rules 4 and 7) — when the request names them (workloads do; Mooncake traces do not).
- The cache is kept at the request's id granularity (512 tokens in Mooncake traces): an id holds
  as many 128-token blocks as the writer had whole (a partial last 512-token block holds fewer).
  Every hit decision goes through `kvledger.core.lookup_hit`; snapshot positions come from
  `prefill_store_positions` / `decode_store_position` (or every N blocks for `periodic:N`); `shared` adds
  rule 4″'s (`core.shared_prefix_positions`: the branch point its CHECK found, and the ends of the first and the
  latest earlier message, a request's segments standing for its messages), which enter the pool as its least
  recently used, as the live pool's extras do.
- Blocks are written at the end of prefill (in-flight prompts are not yet hits), tail first, so
  LRU eviction takes chain tails before heads; a hit renews the TTL of the blocks it reuses.
- `ideal`: one unbounded set of ids, no TTL, no cap, written at the writer's arrival: the hit of
  a request is its leading ids seen before (the reuse ceiling, when repeats are prefixes).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvledger.bench.sim_store import DevicePool, SimBlockStore, StatePool
from kvledger.bench.trace import TraceRequest
from kvledger.core import (HitKind, HitLookup, ModelSpec, checkpoint_positions, decode_replica_positions,
                           decode_store_position, lookup_hit, message_snapshot_indices, prefill_store_positions,
                           shared_prefix_positions)
from kvledger.core.plan import PUBLISHED_PREFILL_TOKENS_PER_S
from kvledger.store.lmdb_store import REFRESH_GRAIN_S

ROUTINGS = ("match", "affinity", "random")
# under `match`, how the entrypoint picks among the engines (the live router's policies, entrypoint/router.py)
ENGINE_POLICIES = ("cache-aware", "round-robin", "least-loaded", "prefix-affinity")
SWA_STRATEGIES = ("memory", "shared", "full", "periodic", "zero")
_PREFILL_DONE, _DECODE_DONE, _ARRIVAL, _START = 0, 1, 2, 3  # at equal times, writes land before arrivals


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A cluster and its cache policy. `ttl_s` per TTL class (None: nothing expires);
    `capacity_bytes` is the whole store (split evenly across engines for local caches)."""

    spec: ModelSpec
    prefill_engines: int = 8
    decode_engines: int = 4
    prefill_tps: float = PUBLISHED_PREFILL_TOKENS_PER_S
    fetch_bytes_per_s: float = 10e9
    fetch_latency_s: float = 1e-3
    decode_tps: float = 30.0
    capacity_bytes: float = math.inf
    low_watermark: float = 1.0     # past the capacity, eviction goes down to this share of it (the live store: 0.9)
    segments: bool = False         # the live store's unit: the blocks one write adds are evicted together, a hit
                                   # on one refreshes them all (LmdbStore's segment), and a CHECK refreshes every
                                   # leading block it found (past the hit cap too), a chain tail at most once per
                                   # REFRESH_GRAIN_S; False: each id alone
    ttl_s: Mapping[str, float] | None = None
    routing: str = "match"
    engine_policy: str = "cache-aware"   # `match` only: which engine computes (the live router's policy)
    device_blocks: int = 0         # per prefill engine: its device KV pool, a prefix cache in front of the store
                                   # (sim_store.DevicePool; a hit is raised to what it holds); 0: not modelled
    swa: str = "memory"            # SWA_STRATEGIES: memory = rule 4's snapshots in host pools, shared = those and
                                   # rule 4″'s, full = the window's KV with every block, periodic = every N blocks
                                   # on storage, zero = none
    swa_period: int = 4            # periodic:N — blocks between stored snapshots
    state_slots: int = 4096        # memory — snapshots one engine's host pool holds
    replay: bool = False           # a missing snapshot: bounded replay instead of fallback
    affinity_balance_s: float = 5.0
    ideal: bool = False
    seed: int = 0
    time_scale: float = 1.0        # arrival times are multiplied by this

    def __post_init__(self) -> None:
        assert self.prefill_engines > 0 and self.decode_engines > 0
        assert self.prefill_tps > 0 and self.fetch_bytes_per_s > 0 and self.decode_tps > 0
        assert self.routing in ROUTINGS and self.swa in SWA_STRATEGIES and self.swa_period > 0
        assert self.capacity_bytes >= 0 and self.time_scale > 0 and 0 < self.low_watermark <= 1
        assert self.device_blocks >= 0
        assert self.engine_policy in ENGINE_POLICIES
        assert self.routing == "match" or self.engine_policy == "cache-aware", "local caches route by their own rule"

    @property
    def local(self) -> bool:
        """Per-engine local caches (affinity, random) instead of one shared store (match)."""
        return self.routing != "match"


@dataclass(slots=True)
class SimResult:
    """Per-request outcomes and totals of one run. Rates are in [0, 1]."""

    requests: int = 0
    block_refs: int = 0
    block_hits: float = 0.0          # hash ids reused; fractional where the cap cuts an id's block
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    fetch_bytes: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    store_series: list[tuple[float, int]] = field(default_factory=list)
    evicted_bytes: int = 0
    expired_bytes: int = 0
    decode_blocks_written: int = 0
    state_pool_bytes: int = 0        # snapshots held in host memory at the end (pools only grow: the peak)
    first_turns: int = 0             # requests that are their session's first (workloads; traces name no session)
    first_turn_hits: int = 0         # of those, the ones with a hit (what rule 4″ is for on a hybrid model)
    busy_s: float = 0.0
    makespan_s: float = 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def first_turn_hit_share(self) -> float:
        return self.first_turn_hits / self.first_turns if self.first_turns else 0.0


def reuse_ceiling(requests: Sequence[TraceRequest]) -> float:
    """Share of prompt block references whose id appeared earlier (in a prompt or a decode write)."""
    seen: set[int] = set()
    refs = repeats = 0
    for r in requests:
        for h in r.hash_ids:
            refs += 1
            repeats += h in seen
            seen.add(h)
        seen.update(r.output_hash_ids)
    return repeats / refs if refs else 0.0


def _rendezvous(first_id: int, engine: int) -> bytes:
    """prefix-affinity's score of an engine for a prefix (the highest wins): a hash of both, the same in
    every process."""
    return hashlib.blake2b(struct.pack("<qq", first_id & (2**63 - 1), engine), digest_size=8).digest()


def _ids_hit(r: TraceRequest, hit_tokens: int) -> float:
    """How many of r's ids lie in [0, hit_tokens), counting a cut id by its covered share."""
    bt = r.block_tokens
    whole = min(hit_tokens // bt, len(r.hash_ids))
    if whole == len(r.hash_ids):
        return float(whole)
    rest = hit_tokens - whole * bt
    return whole + (rest / r.block_len(whole) if rest > 0 else 0.0)


class _Decision:
    """A hit decision plus where its snapshot is (`snap_key` in the pool of `holder`, or on storage)."""

    __slots__ = ("hit_tokens", "recompute_from", "kind", "l1", "swa_bytes", "holder", "snap_key", "on_device", "cached",
                 "shared")

    def __init__(self, hit_tokens: int, recompute_from: int, kind: str, l1: int, swa_bytes: int = 0,
                 holder: int | None = None, snap_key: tuple | None = None) -> None:
        self.hit_tokens, self.recompute_from, self.kind, self.l1 = hit_tokens, recompute_from, kind, l1
        self.swa_bytes, self.holder, self.snap_key = swa_bytes, holder, snap_key
        self.on_device = 0   # of the reused blocks, those the serving engine's device pool holds (not fetched)
        self.cached = 0      # leading blocks the store held at the CHECK (what it refreshed, with `segments`)
        self.shared: tuple[int, ...] = ()   # `shared`: rule 4″'s positions, where this prefill also snapshots


class Simulator:
    """One run over `requests` (sorted by arrival) under `cfg`; `run()` returns the SimResult."""

    def __init__(self, requests: Sequence[TraceRequest], cfg: SimConfig) -> None:
        spec = cfg.spec
        self.reqs, self.cfg, self.spec, self.B = requests, cfg, spec, spec.block_size
        for r in requests:
            if r.block_tokens % self.B:
                raise ValueError(f"request blocks of {r.block_tokens} tokens are not whole {self.B}-token blocks")
        n, m = cfg.prefill_engines, cfg.decode_engines
        per_store = cfg.capacity_bytes / n if cfg.local else cfg.capacity_bytes
        self.stores = [SimBlockStore(per_store, cfg.low_watermark) for _ in range(n if cfg.local else 1)]
        self.pools = [StatePool(cfg.state_slots) for _ in range(n + m)]
        self.busy = [0.0] * n
        self.queued: list[list[float]] = [[] for _ in range(n)]   # least-loaded: when each engine's prefills end
        self.served = [0] * n                                       # requests each prefill engine computed
        self.devices = [DevicePool(cfg.device_blocks) for _ in range(n)] if cfg.device_blocks and not cfg.ideal else []
        self.taken: dict[int, int] = {}                             # request → device blocks it took, until its end
        self.reused_on_device: dict[int, int] = {}                  # request → its reused blocks already there
        self.walked: dict[int, float] = {}                          # `segments`: chain tail → its last refresh
        self.turn = 0                                               # round-robin's next engine
        self.decoding = [0] * m
        self.rng = random.Random(cfg.seed)
        self.swa_block_bytes = spec.swa_stored_layers * self.B * spec.swa_bytes_per_token if spec.has_swa else 0
        self.unit_bytes = spec.block_bytes() + (self.swa_block_bytes if cfg.swa == "full" else 0)
        self.snapshot_bytes = spec.state_size_to_disk() if spec.has_swa else 0
        window_blocks = -(-spec.inference_ring() // self.B)
        self.full_window_bytes = window_blocks * self.swa_block_bytes
        self.ideal_seen: set[int] = set()
        self.sessions_begun: set[int] = set()                       # sessions whose first request was decided
        self.res = SimResult(kinds={k.value: 0 for k in HitKind})

    # --- helpers ------------------------------------------------------------------

    def _ttl(self, r: TraceRequest) -> float:
        return math.inf if self.cfg.ttl_s is None else self.cfg.ttl_s[r.ttl_class]

    def _id_at(self, r: TraceRequest, pos: int) -> int | None:
        """Id of the block holding token pos − 1 of prompt + output (None: unknown)."""
        i = (pos - 1) // r.block_tokens
        first_out = r.input_length // r.block_tokens
        if pos <= r.input_length and i < len(r.hash_ids):
            return r.hash_ids[i]
        j = i - first_out
        return r.output_hash_ids[j] if 0 <= j < len(r.output_hash_ids) else None

    def _cached_blocks(self, r: TraceRequest, store: SimBlockStore, now: float) -> int:
        """Leading 128-token blocks of r's prompt the store holds (stops inside a short entry)."""
        per, blocks = r.block_tokens // self.B, 0
        for i, h in enumerate(r.hash_ids):
            units = store.units(h, now)
            if units == 0:
                break
            blocks += min(units, r.block_len(i) // self.B)
            if units < per:
                break
        return blocks

    def _decide(self, r: TraceRequest, engine: int, now: float) -> _Decision:
        """The hit of r on `engine`: `core.lookup_hit` over the cached blocks and the snapshots reachable at the
        positions it may use (L1 alone for a model that falls back, every boundary up to L1 for one that resumes
        exactly, rule 3′). Only the highest reachable one can decide (a snapshot at L1, else the latest q < L1),
        so the search stops there. `l1` stays the blocks' L1 (what the CHECK refreshes), also when an exact
        resume starts earlier."""
        store = self.stores[engine if self.cfg.local else 0]
        return self._decide_blocks(r, self._cached_blocks(r, store, now), engine, store, now)

    def _decide_blocks(self, r: TraceRequest, cached: int, engine: int, store: SimBlockStore, now: float
                       ) -> _Decision:
        """The hit of r with `cached` leading blocks in hand (`_decide`)."""
        cfg = self.cfg
        found: dict[int, tuple[int, int | None, tuple | None]] = {}

        def highest_reachable(at: Sequence[int]) -> set[int]:
            """The highest of `at` whose snapshot is reachable (`lookup_hit` needs no other), noting where it is."""
            for pos in reversed(at):
                where = self._snapshot(r, pos, engine, store, now)
                if where is not None:
                    found[pos] = where
                    return {pos}
            return set()

        hit = lookup_hit(r.input_length, cached, highest_reachable, self.spec, replay=cfg.replay or cfg.swa == "zero")
        d = hit.decision
        out = (_Decision(d.hit_tokens, d.recompute_from, d.kind.value, hit.l1, *found[d.hit_tokens]) if d.swa_hit
               else _Decision(d.hit_tokens, d.recompute_from, d.kind.value, hit.l1))
        out.cached = cached
        if cfg.swa == "shared":
            out.shared = self._shared_positions(r, hit)
        return out

    def _shared_positions(self, r: TraceRequest, hit: HitLookup) -> tuple[int, ...]:
        """Rule 4″'s positions for r's prefill, below its own rule-4 ones (`core.checkpoint_positions`): the branch
        point and the ends of the messages `core.message_snapshot_indices` names, r's prompt segments standing for
        its messages (none when the request names no segments, as in Mooncake traces)."""
        ends, at = [], 0
        for seg in r.segments:
            at += seg.length
            if at > r.input_length:
                break
            ends.append(at)
        chosen = [ends[k] for k in message_snapshot_indices(len(ends))]
        also = shared_prefix_positions(hit, self.spec, chosen)
        return checkpoint_positions(r.input_length, self.spec, 0, also=also)

    def _snapshot(self, r: TraceRequest, pos: int, engine: int, store: SimBlockStore, now: float
                  ) -> tuple[int, int | None, tuple | None] | None:
        """None when no snapshot at `pos` of r's prefix is reachable from `engine`; else
        (bytes moved to use it, holding engine or None for storage, its key). Touches nothing."""
        swa = self.cfg.swa
        if swa == "full":  # the window's SWA KV is stored with the blocks below pos, all cached
            return self.full_window_bytes, None, None
        if swa == "zero":
            return None
        key = (self._id_at(r, pos), pos)
        if swa == "periodic":
            if pos % (self.cfg.swa_period * self.B) or not store.units(("s", *key), now):
                return None
            return self.snapshot_bytes, None, ("s", *key)
        candidates = [engine] if self.cfg.local else [engine, *(e for e in range(len(self.pools)) if e != engine)]
        for e in candidates:
            if key in self.pools[e]:
                return self.snapshot_bytes, e, key
        return None

    def _service(self, r: TraceRequest, d: _Decision, engine: int) -> tuple[float, float, int]:
        """(fetch seconds, compute seconds, bytes fetched) of r on `engine` under decision d.
        A snapshot in the serving engine's own pool costs nothing to use; elsewhere it is pulled."""
        cfg = self.cfg
        nbytes = max(-(-d.hit_tokens // self.B) - d.on_device, 0) * self.spec.block_bytes()   # blocks spanned
        if d.holder is None or d.holder != engine:
            nbytes += d.swa_bytes
        fetch = cfg.fetch_latency_s + nbytes / cfg.fetch_bytes_per_s if nbytes else 0.0
        return fetch, (r.input_length - d.recompute_from) / cfg.prefill_tps, nbytes

    # --- events ---------------------------------------------------------------------

    def _route(self, r: TraceRequest, now: float) -> tuple[int, _Decision]:
        cfg, n = self.cfg, self.cfg.prefill_engines
        wait = [max(b - now, 0.0) for b in self.busy]
        if cfg.routing == "random":
            e = self.rng.randrange(n)
            return e, self._decide(r, e, now)
        if cfg.routing == "match":
            d = self._decide(r, 0, now)
            e = self._pick(r, d, now, wait)
            return e, self._local_holder(d, e)
        decisions = [self._decide(r, e, now) for e in range(n)]
        best = max(range(n), key=lambda i: (decisions[i].hit_tokens, -wait[i], -i))
        idle = min(range(n), key=lambda i: (wait[i], i))
        if decisions[best].hit_tokens == 0 or wait[best] - wait[idle] > cfg.affinity_balance_s:
            best = idle
        return best, decisions[best]

    def _pick(self, r: TraceRequest, d: _Decision, now: float, wait: list[float]) -> int:
        """The engine `match` sends r to, by `engine_policy` (entrypoint/router.py's table): cache-aware = the
        least queueing + service; round-robin = the next in turn; least-loaded = the fewest prefills admitted
        and not done; prefix-affinity = a rendezvous hash of the first block's id (every engine when r has no
        full block: a hash of its length). Ties go to the lowest index."""
        n, policy = self.cfg.prefill_engines, self.cfg.engine_policy
        if policy == "round-robin":
            self.turn += 1
            return (self.turn - 1) % n
        if policy == "least-loaded":
            for q in self.queued:
                q[:] = [t for t in q if t > now]
            return min(range(n), key=lambda i: (len(self.queued[i]), i))
        if policy == "prefix-affinity":
            first = r.hash_ids[0] if r.hash_ids else r.input_length
            return max(range(n), key=lambda i: (_rendezvous(first, i), -i))
        return min(range(n), key=lambda i: (wait[i] + sum(self._service(r, self._local_holder(d, i), i)[:2]), i))

    def _with_device(self, r: TraceRequest, engine: int, d: _Decision, now: float) -> _Decision:
        """The engine's device pool may hold more leading blocks than the store: the hit is raised to them, as
        engine/loader.py does (`_with_device_cache`); either way its blocks there are not fetched."""
        device = self.devices[engine].cache
        held = self._cached_blocks(r, device, now)
        reach = d.hit_tokens if d.kind in ("snapshot", "miss") else d.l1   # the decision's block_hit_tokens
        if held * self.B > reach:
            store = self.stores[engine if self.cfg.local else 0]
            better = self._decide_blocks(r, held, engine, store, now)
            if better.hit_tokens > d.hit_tokens:
                d = better
        d.on_device = min(held, -(-d.hit_tokens // self.B))
        for h in reversed(r.hash_ids[: -(-d.hit_tokens // r.block_tokens)]):
            device.touch(h, now, math.inf)
        return d

    def _admit(self, r: TraceRequest, engine: int, d: _Decision) -> int:
        """Blocks r takes from the engine's device pool at admission (prompt + output, + 1 if windowed, less
        the reused ones it already holds: engine/loader.py `blocks_needed`)."""
        need = -(-(r.input_length + r.output_length) // self.B) + (1 if self.spec.has_swa else 0)
        taken = max(need - d.on_device, 0)
        self.devices[engine].take(taken)
        return taken

    def _local_holder(self, d: _Decision, engine: int) -> _Decision:
        """d with `engine` as the holder when its own pool has the snapshot too (no pull needed)."""
        if d.holder is None or d.holder == engine or d.snap_key not in self.pools[engine]:
            return d
        out = _Decision(d.hit_tokens, d.recompute_from, d.kind, d.l1, d.swa_bytes, engine, d.snap_key)
        out.cached, out.shared = d.cached, d.shared
        return out

    def _touch_reused(self, r: TraceRequest, store: SimBlockStore, d: _Decision, now: float) -> None:
        """A hit renews what it reuses: its blocks (tail first) and its snapshot. With `segments`, as the live
        CHECK does: every leading block the store held, past the hit cap too (and their segments whole)."""
        ttl = self._ttl(r)
        upto = d.cached * self.B if self.cfg.segments else d.l1
        ids = r.hash_ids[: -(-upto // r.block_tokens)]
        if ids and self.cfg.segments:   # the live CHECK walks a chain tail at most once per REFRESH_GRAIN_S
            if now - self.walked.get(ids[-1], -math.inf) < REFRESH_GRAIN_S:
                ids = ()
            else:
                self.walked[ids[-1]] = now
        for h in reversed(ids):
            store.touch(h, now, ttl)
        if d.snap_key is not None:
            if d.holder is not None:
                self.pools[d.holder].touch(d.snap_key)
            else:
                store.touch(d.snap_key, now, ttl)

    def _write_prompt(self, r: TraceRequest, engine: int, now: float, d: _Decision) -> None:
        store, ttl, B = self.stores[engine if self.cfg.local else 0], self._ttl(r), self.B
        # snapshots first (useless without their blocks, they go before them), then blocks tail first; rule 4″'s
        # enter as the least recently used, so they go before rule 4's unless a hit reads them
        self._store_snapshots(r, engine, now, list(d.shared), store, extra=True)
        self._store_snapshots(r, engine, now, self._prefill_positions(r), store)
        for i in range(len(r.hash_ids) - 1, -1, -1):
            units = r.block_len(i) // B
            if units:
                store.put(r.hash_ids[i], units, units * self.unit_bytes, now, ttl, self._segment(r, "prompt"))

    def _segment(self, r: TraceRequest, part: str) -> tuple | None:
        """The group the blocks r's `part` write adds join (None: each its own; `SimConfig.segments`)."""
        return (part, id(r)) if self.cfg.segments else None

    def _prefill_positions(self, r: TraceRequest) -> list[int]:
        positions = prefill_store_positions(r.input_length, self.spec)
        if not positions:
            return []
        if self.cfg.swa == "periodic":
            step = self.cfg.swa_period * self.B
            return list(range(step, positions[-1] + 1, step))
        return list(positions) if self.cfg.swa in ("memory", "shared") else []

    def _store_snapshots(self, r: TraceRequest, engine: int, now: float, positions: list[int],
                         store: SimBlockStore, *, extra: bool = False) -> None:
        for p in positions:
            h = self._id_at(r, p)
            if h is None:
                continue
            if self.cfg.swa == "periodic":
                store.put(("s", h, p), 1, self.snapshot_bytes, now, self._ttl(r))
            else:
                self.pools[engine].put((h, p), extra=extra)

    def _write_decode(self, r: TraceRequest, prefill_engine: int, decode_engine: int, now: float) -> None:
        cfg = self.cfg
        store, ttl, per = self.stores[prefill_engine if cfg.local else 0], self._ttl(r), r.block_tokens // self.B
        for h in reversed(r.output_hash_ids):
            store.put(h, per, per * self.unit_bytes, now, ttl, self._segment(r, "decode"))
        self.res.decode_blocks_written += len(r.output_hash_ids) * per
        total = r.input_length + r.output_length
        if cfg.swa in ("memory", "shared"):
            q = decode_store_position(r.input_length, total, self.spec)
            holder = prefill_engine if cfg.local else cfg.prefill_engines + decode_engine
            self._store_snapshots(r, holder, now, [q] if q else [], store)
        elif cfg.swa == "periodic":
            step = cfg.swa_period * self.B
            qs = [q for q in decode_replica_positions(r.input_length, total, self.spec) if q % step == 0]
            self._store_snapshots(r, prefill_engine, now, qs, store)

    def _keep_on_device(self, r: TraceRequest, engine: int, ids: Sequence[int], now: float) -> None:
        """These full blocks of r become findable in the engine's device pool (tail first, as the store puts)."""
        per = r.block_tokens // self.B
        for k in range(len(ids) - 1, -1, -1):
            units = r.block_len(k) // self.B if ids is r.hash_ids else per
            if units:
                self.devices[engine].keep(ids[k], units, now)

    def _arrive_ideal(self, r: TraceRequest) -> _Decision:
        found = 0
        for h in r.hash_ids:
            if h not in self.ideal_seen:
                break
            found += 1
        self.ideal_seen.update(r.hash_ids)
        self.ideal_seen.update(r.output_hash_ids)
        hit = min(found * r.block_tokens, r.input_length)
        return _Decision(hit, hit, HitKind.FULL.value if hit else HitKind.MISS.value, hit)

    def run(self) -> SimResult:
        """Events in time order; at equal times prefill writes, then decode writes, then arrivals, then starts.

        Without a device pool a request's decision and service are fixed at its arrival (it starts when its
        engine's FIFO queue reaches it). With one (`device_blocks`), the store's decision is still made at
        arrival (the CHECK, before routing), but the engine raises it to what its device pool holds when the
        request starts (admission, engine/loader.py): requests wait in a queue per engine for that moment."""
        cfg, res = self.cfg, self.res
        events: list[tuple[float, int, int, int, int]] = []
        for i, r in enumerate(self.reqs):
            events.append((r.arrival_s * cfg.time_scale, _ARRIVAL, i, 0, 0))
        heapq.heapify(events)
        engine_of = [0] * len(self.reqs)
        decided: list[_Decision | None] = [None] * len(self.reqs)   # each request's final decision, for its writes
        ttft = [0.0] * len(self.reqs)
        waiting: list[list[tuple[int, _Decision, float]]] = [[] for _ in range(cfg.prefill_engines)]
        running = [False] * cfg.prefill_engines
        while events:
            now, kind, i, a, b = heapq.heappop(events)
            r = self.reqs[i]
            if kind == _ARRIVAL:
                for s in self.stores:
                    s.expire(now)
                if cfg.ideal:
                    d = self._arrive_ideal(r)
                    e = min(range(cfg.prefill_engines), key=lambda k: (self.busy[k], k))
                else:
                    e, d = self._route(r, now)
                    self._touch_reused(r, self.stores[e if cfg.local else 0], d, now)
                fetch, compute, nbytes = self._service(r, d, e)
                start = max(now, self.busy[e])
                self.busy[e] = done = start + fetch + compute   # with a device pool: an estimate, for routing
                self.served[e] += 1
                if cfg.engine_policy == "least-loaded":
                    self.queued[e].append(done)
                engine_of[i] = e
                res.store_series.append((now, sum(s.bytes for s in self.stores)))
                if self.devices:
                    waiting[e].append((i, d, now))
                    if not running[e]:
                        running[e] = True
                        heapq.heappush(events, (now, _START, waiting[e][0][0], e, 0))
                    continue
                self._account(r, d, fetch, compute, nbytes)
                decided[i] = d
                ttft[i] = done - now
                heapq.heappush(events, (done, _PREFILL_DONE, i, e, 0))
            elif kind == _START:
                j, d, arrived = waiting[a].pop(0)
                assert j == i
                d = self._with_device(r, a, d, now)
                self.taken[i] = self._admit(r, a, d)
                self.reused_on_device[i] = d.on_device
                fetch, compute, nbytes = self._service(r, d, a)
                self._account(r, d, fetch, compute, nbytes)
                decided[i] = d
                done = now + fetch + compute
                ttft[i] = done - arrived
                heapq.heappush(events, (done, _PREFILL_DONE, i, a, 0))
            elif kind == _PREFILL_DONE:
                if not cfg.ideal:
                    self._write_prompt(r, a, now, decided[i])
                if self.devices:   # its new full blocks stop being merely taken: they are kept, findable
                    moved = min(self.taken[i], max(r.input_length // self.B - self.reused_on_device.pop(i), 0))
                    self.taken[i] -= moved
                    self.devices[a].give_back(moved)
                    self._keep_on_device(r, a, r.hash_ids, now)
                    if waiting[a]:
                        heapq.heappush(events, (now, _START, waiting[a][0][0], a, 0))
                    else:
                        running[a] = False
                m = min(range(cfg.decode_engines), key=lambda k: (self.decoding[k], k))
                self.decoding[m] += 1
                heapq.heappush(events, (now + r.output_length / cfg.decode_tps, _DECODE_DONE, i, a, m))
            else:
                self.decoding[b] -= 1
                if not cfg.ideal:
                    self._write_decode(r, engine_of[i], b, now)
                if self.devices:
                    self._keep_on_device(r, engine_of[i], r.output_hash_ids, now)
                    self.devices[engine_of[i]].give_back(self.taken.pop(i))
            res.makespan_s = now
        res.ttft_s = ttft
        res.evicted_bytes = sum(s.evicted_bytes for s in self.stores)
        res.expired_bytes = sum(s.expired_bytes for s in self.stores)
        res.state_pool_bytes = sum(len(p) for p in self.pools) * self.snapshot_bytes
        return res

    def _account(self, r: TraceRequest, d: _Decision, fetch: float, compute: float, nbytes: float) -> None:
        """A request's figures, once its decision is final."""
        res = self.res
        res.busy_s += fetch + compute
        res.requests += 1
        res.block_refs += len(r.hash_ids)
        res.block_hits += _ids_hit(r, d.hit_tokens)
        res.prompt_tokens += r.input_length
        res.hit_tokens += d.hit_tokens
        res.computed_tokens += r.input_length - d.recompute_from
        res.fetch_bytes += nbytes
        res.kinds[d.kind] += 1
        if r.session >= 0 and r.session not in self.sessions_begun:
            self.sessions_begun.add(r.session)
            res.first_turns += 1
            res.first_turn_hits += d.hit_tokens > 0


def simulate(requests: Sequence[TraceRequest], cfg: SimConfig) -> SimResult:
    return Simulator(requests, cfg).run()


def downsample(series: Sequence[tuple[float, int]], n: int = 200) -> list[list[float]]:
    """At most about n points of a (time, bytes) series, first point kept."""
    step = max(len(series) // n, 1)
    return [[round(t, 3), b] for t, b in series[::step]]


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0
