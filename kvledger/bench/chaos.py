"""`kvledger bench chaos`: the cluster on a real JuiceFS volume under faults, every reply checked.

The cluster: `kvledger up --juicefs --juicefs-mounts 2` (a JuiceFS volume with its metadata on a Redis of its
own, two clients of it, as two machines), kvledger's Redis, 2 prefill engines and 1 decode engine, tiny-v4.
The load: 3 clients running bounded multi-turn conversations with shared system prompts, greedy
(chaos_load.py). The faults, one kind at a time, `--trials` each (chaos_faults.py): SIGKILL of a prefill
engine mid-prefill and of the decode engine mid-stream, SIGSTOP of an engine for 10 s, SIGKILL of Redis and
SIGSTOP of it for 5 s, a JuiceFS client killed, segment files corrupted, truncated or deleted, the volume
filled, a segment folder made read-only. Nobody repairs anything: `up` restarts what died.

After each fault, recovery is measured by a probe: a prompt of its own sent every PROBE_EVERY_S; the
cluster is back when /health lists every engine and the probe's repeat hits exactly (its rule-4 snapshot
at its cap), i.e. the hit rate is back. A trial that is not back within `--recovery-limit-s` counts as a
manual restart needed (the cluster is then restarted, to go on).

("Every engine" means the entrypoint lists 3 and each answers its internal health as ok.)

The check, after the run: every completed reply against no-cache single-process servers (one per usable CPU,
up to MAX_REFERENCES), each reply asked in one request whatever legs it took (chaos_load.py). The JSON:
`requests`, `completed`, `failed` (by fault kind and HTTP status), `wrong_answers`, `hung` (over 60 s),
`max_recovery_s` per fault kind, `cached_overclaimed` (usage claiming more reuse than the engine's own forward
count allows), `manual_restart_needed`, and each trial's figures (what the fault did, its recovery, the hit rate
before, during and after).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvledger.bench.chaos_faults import FAULTS
from kvledger.bench.chaos_load import HUNG_S, Load, Sample, check_against, complete
from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.output import CliError, emit_json

HELP = "the cluster on JuiceFS under faults: wrong answers, failures, recovery times"
EXAMPLES = ("kvledger bench chaos --json", "kvledger bench chaos --short --faults kill_prefill,kill_mount --json")
PROBE_EVERY_S = 1.0
PROBE_TOKENS = 600
SHORT_HOLD = 0.5        # --short: holds (SIGSTOP, a full volume, a read-only folder) at this fraction
WARMUP_S = 10.0         # load before the first fault: prefixes get cached, so faults hit a warm cluster
SHORT_WARMUP_S = 5.0    # --short: enough for every conversation's first turns to be stored
SHORT_SETTLE_S = 1.0    # --short's default --settle-s
MAX_REFERENCES = 4      # no-cache reference servers the check runs at once
SETTLE_REPLIES = 3      # and on after it, until this many replies sent after the recovery are in (a slow machine
                        # answers fewer a second; a trial's hit rate after it needs replies to be a rate)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", default=",".join(FAULTS), help="fault kinds to run, comma-separated, in order")
    p.add_argument("--trials", type=int, default=3, help="trials of each fault kind (default %(default)s)")
    p.add_argument("--short", action="store_true", help="the test suite's form: 1 trial each, holds halved "
                   "(SIGSTOP of an engine 5 s: still past the entrypoint's 3 s leg deadline)")
    p.add_argument("--clients", type=int, default=3, help="concurrent conversations (default %(default)s)")
    p.add_argument("--recovery-limit-s", type=float, default=120.0, help="a trial not back within this long "
                   "needs a manual restart (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=None, help="load between one trial's recovery and the next "
                   f"fault (default 3.0; {SHORT_SETTLE_S} with --short), and on until {SETTLE_REPLIES} replies sent "
                   "after the recovery are in")
    p.add_argument("--data-dir", type=Path, default=None, help="the cluster's data dir, empty or absent (default: a "
                   "temp dir, removed after)")
    p.add_argument("--seed", type=int, default=1, help="the load's and the faults' random seed")


def run(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if not kinds or any(k not in FAULTS for k in kinds):
        raise CliError(f"--faults: each of {', '.join(FAULTS)}")
    if args.settle_s is None:
        args.settle_s = SHORT_SETTLE_S if args.short else 3.0
    if args.trials < 1 or args.clients < 1 or args.recovery_limit_s <= 0 or args.settle_s < 0:
        raise CliError("--trials and --clients must be >= 1, --recovery-limit-s > 0, --settle-s >= 0")
    if args.data_dir is not None and args.data_dir.exists() and any(args.data_dir.iterdir()):
        # a cluster left there would serve this run blocks and states of the last one, which another kvledger
        # version may have computed with other floats: its replies would differ from the reference's
        raise CliError(f"--data-dir {args.data_dir}: not empty (the chaos run starts its cluster from nothing)")
    from kvledger.util.juicefs import fuse_unavailable

    if (why := fuse_unavailable()) is not None:
        raise CliError(f"the chaos run needs JuiceFS: {why}")
    trials = 1 if args.short else args.trials
    scale = SHORT_HOLD if args.short else 1.0
    tmp = None if args.data_dir else tempfile.mkdtemp(prefix="kvledger-chaos-")
    data = Path(args.data_dir or tmp)
    try:
        chaos = Chaos(data, args.clients, args.seed, args.recovery_limit_s, args.settle_s,
                      SHORT_WARMUP_S if args.short else WARMUP_S)
        result = chaos.run([(k, t) for k in kinds for t in range(trials)], scale)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result["config"] = {"faults": kinds, "trials": trials, "clients": args.clients, "short": args.short,
                        "hold_scale": scale, "warmup_s": chaos.warmup_s, "settle_s": args.settle_s}
    if args.json:
        emit_json(result)
    else:
        _print(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "chaos.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def cluster_args() -> list[str]:
    return ["--juicefs", "--juicefs-mounts", "2", "--juicefs-capacity", "1GiB", "--grace-s", "1"]


class Chaos:
    def __init__(self, data: Path, clients: int, seed: int, recovery_limit_s: float, settle_s: float,
                 warmup_s: float = WARMUP_S) -> None:
        self.data, self.clients, self.seed = data, clients, seed
        self.limit_s, self.settle_s, self.warmup_s = recovery_limit_s, settle_s, warmup_s
        self.rng = random.Random(seed)
        self.fault = ""                 # the fault in effect: what each sample is tagged with
        self.trials: list[dict[str, Any]] = []
        self.manual_restarts = 0
        self.cluster: ClusterProcess | None = None

    def _start_cluster(self) -> ClusterProcess:
        self.cluster = ClusterProcess(self.data / "cluster", *cluster_args(), prefill=2, decode=1,
                                      model="tiny-v4").start()
        return self.cluster

    def run(self, plan: list[tuple[str, int]], scale: float) -> dict[str, Any]:
        started = time.monotonic()
        cluster = self._start_cluster()
        load = Load(cluster.url, self.clients, self.seed, lambda: self.fault).start()
        try:
            time.sleep(self.warmup_s)
            for kind, trial in plan:
                self.trials.append(self._trial(load, kind, trial, scale))
                self._settle(load, self.trials[-1])
        finally:
            load.stop()
            if self.cluster is not None:
                self.cluster.stop()
        ran_s = time.monotonic() - started
        return self._report(load.samples, ran_s) | {"trials": self.trials}

    def _trial(self, load: Load, kind: str, trial: int, scale: float) -> dict[str, Any]:
        assert self.cluster is not None
        fault, hold_s, _ = FAULTS[kind]
        self.fault = f"{kind}#{trial}"
        t0 = load.now()
        note = fault(self.cluster, self.rng, hold_s * scale)
        t1 = load.now()
        recovery = self._recovered(load, trial)
        if recovery is None:   # not back by itself: restart the whole cluster, as a person would
            self.manual_restarts += 1
            self.cluster.stop()
            self._start_cluster()
            load.url = self.cluster.url
        self.fault = ""
        return {"kind": kind, "trial": trial, "note": note, "started_s": round(t0, 2), "ended_s": round(t1, 2),
                "recovery_s": None if recovery is None else round(recovery, 2),
                "hit_rate_before": _hit_rate(load.samples, t0 - 15, t0),
                "hit_rate_during": _hit_rate(load.samples, t0, t1 + (recovery or 0)),
                "hit_rate_after": None}   # filled in by _report, once later samples are in

    def _settle(self, load: Load, trial: dict[str, Any]) -> None:
        """Let the load run `settle_s` after a trial, and on until SETTLE_REPLIES replies sent after its recovery
        have completed; at most the recovery limit."""
        back = trial["ended_s"] + (trial["recovery_s"] or 0)
        time.sleep(self.settle_s)
        deadline = time.monotonic() + self.limit_s
        while time.monotonic() < deadline and sum(s.sent >= back and s.completed
                                                  for s in list(load.samples)) < SETTLE_REPLIES:
            time.sleep(0.2)

    def _recovered(self, load: Load, trial: int) -> float | None:
        """Seconds from the fault's end until every engine is listed and a repeated probe hits exactly; None when
        that did not happen within the limit."""
        from kvledger.core import ModelSpec, decide_hit, prefill_store_positions

        assert self.cluster is not None
        spec = ModelSpec.preset("tiny-v4")
        probe = [self.rng.randrange(3, 32000) for _ in range(PROBE_TOKENS)]
        expected = decide_hit(len(probe), len(probe) // spec.block_size,
                              set(prefill_store_positions(len(probe), spec)), spec).hit_tokens
        ended = time.monotonic()
        while (waited := time.monotonic() - ended) < self.limit_s:
            if self._engines_listed() == 3 and self._engines_healthy():
                status, body, _ = complete(self.cluster.url, probe, 2, timeout_s=30)
                cached = (body.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", -1)
                if status == 200 and cached == expected:
                    return waited
            time.sleep(PROBE_EVERY_S)
        return None

    def _engines_healthy(self) -> bool:
        """Every engine answers its internal health as ok (at the URL of its latest start): a dead one whose
        registry entry has not expired yet does not count."""
        assert self.cluster is not None
        names = [n for n in self.cluster.members if n.startswith(("prefill-", "decode-"))]
        try:
            return all(self.cluster.engine_get(n, "/engine/v1/health")[0] == 200 for n in names)
        except Exception:  # noqa: BLE001 - refused, reset, timed out: not back yet
            return False

    def _engines_listed(self) -> int:
        from kvledger.util.serve_process import request

        assert self.cluster is not None
        try:
            status, raw = request(self.cluster.url + "/health", timeout=5)
            return int(json.loads(raw).get("engines", 0)) if status == 200 else 0
        except (OSError, ValueError):
            return 0

    def _report(self, samples: list[Sample], ran_s: float) -> dict[str, Any]:
        for i, t in enumerate(self.trials):   # after the recovery, until the next fault (or 15 s)
            back = t["ended_s"] + (t["recovery_s"] or 0)
            end = self.trials[i + 1]["started_s"] if i + 1 < len(self.trials) else back + 15
            t["hit_rate_after"] = _hit_rate(samples, back, end)
        checked = self._check(samples)
        failed: dict[str, dict[str, int]] = {}
        for s in samples:
            if not s.completed:
                by_status = failed.setdefault(s.fault.split("#")[0] or "none", {})
                key = str(s.status) if s.status else "no answer"
                by_status[key] = by_status.get(key, 0) + 1
        recovery: dict[str, list[float | None]] = {}
        for t in self.trials:
            recovery.setdefault(t["kind"], []).append(t["recovery_s"])
        latencies = sorted(s.elapsed for s in samples if s.completed)
        return {
            "requests": len(samples),
            "completed": sum(1 for s in samples if s.completed),
            "failed": failed,
            "failure_examples": [{"fault": s.fault, "status": s.status, "error": s.error}
                                 for s in samples if not s.completed][:10],
            "wrong_answers": len(checked.wrong),
            "wrong_examples": checked.wrong[:5],
            "unchecked": checked.unchecked,
            "hung": sum(1 for s in samples if s.elapsed > HUNG_S),
            "max_recovery_s": {k: (None if None in v else max(v)) for k, v in recovery.items()},
            "recovery_s": recovery,
            "cached_overclaimed": sum(1 for s in samples if s.completed and s.overclaimed()),
            "manual_restart_needed": self.manual_restarts,
            "hit_rate": _hit_rate(samples, 0, ran_s),
            "latency_s": {"p50": _q(latencies, 0.5), "p99": _q(latencies, 0.99), "max": _q(latencies, 1.0)},
            "duration_s": round(ran_s, 1),
        }

    def _check(self, samples: list[Sample]) -> Any:
        """On one no-cache reference server per usable CPU (up to MAX_REFERENCES), each on one torch thread: the
        check is CPU-bound, and tiny-v4 computes each sequence of a batch on its own, so a server uses one core."""
        from kvledger.engine.defaults import DEFAULTS
        from kvledger.engine.threads import usable_cpus
        from kvledger.util.serve_process import ServeProcess

        references = [ServeProcess(self.data / f"reference-{i}", "--no-cache", "--max-num-seqs",
                                   str(DEFAULTS.max_num_seqs), "--threads", "1", model="tiny-v4")
                      for i in range(min(MAX_REFERENCES, usable_cpus()))]
        try:
            for reference in references:
                reference.launch()
            for reference in references:
                reference.wait_ready()
            return check_against([r.url for r in references], samples)
        finally:
            for reference in references:
                reference.stop()


def _hit_rate(samples: list[Sample], start: float, end: float) -> float | None:
    """Cached over prompt tokens of the replies completed among those sent in [start, end) s."""
    window = [s for s in samples if start <= s.sent < end and s.completed]
    prompt = sum(len(s.prompt) for s in window)
    return round(sum(s.cached for s in window) / prompt, 3) if prompt else None


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _print(r: dict[str, Any]) -> None:
    print(f"requests {r['requests']}, completed {r['completed']}, wrong answers {r['wrong_answers']}, "
          f"hung {r['hung']}, cached over-claimed {r['cached_overclaimed']}, manual restarts "
          f"{r['manual_restart_needed']}, hit rate {r['hit_rate']}")
    print(f"failed: {r['failed'] or 'none'}")
    for t in r["trials"]:
        print(f"  {t['kind']:<16} #{t['trial']}  recovered in {t['recovery_s']} s  hit rate "
              f"{t['hit_rate_before']} → {t['hit_rate_during']} → {t['hit_rate_after']}  ({t['note']})")
    print("max recovery s: " + ", ".join(f"{k} {v}" for k, v in r["max_recovery_s"].items()))
