"""`kvledger bench serve`: `kvledger serve` under concurrent multi-turn chats, with and without the cache.

The workload is the simulator's chat workload (`workloads.chat`) scaled down to a 2-core CPU:
`--sessions` sessions, their shared system prompts (Zipf over 6) and user turns with every
length times `--length-scale`, at most `--max-turns` turns each. Each turn is sent as token ids
(the segments' seeded ids) and the next turn's prompt is the previous prompt + the model's real
reply + the next user turn, so the decode blocks a reply stored (rule 7) can hit. Replies are
greedy with `ignore_eos`, `min(reply length × scale, --reply-tokens)` tokens, so both runs do the
same work. Sessions run closed-loop, `--concurrency` at a time, no think time.

Two servers run the same workload one after the other, each on a fresh data directory: one
with the cache, one with `--no-cache` (CHECK skipped, every prompt computed in full). Cold and
warm requests are told apart by the cache run (cached tokens 0 or > 0); the no-cache run's
figures are for the same requests.

`--against vllm` runs another comparison instead: `kvledger serve` against `vllm serve` under vLLM's own
client (serve_vllm.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.bench.serve_vllm import add_against_arguments, run_against_vllm

HELP = "kvledger serve under concurrent multi-turn chats, side by side with --no-cache"
EXAMPLES = ("kvledger bench serve --json", "kvledger bench serve --against vllm --record docs/results")
MODES = ("cache", "no_cache")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.add_argument("--sessions", type=int, default=6, help="chat sessions (the workload's first N)")
    p.add_argument("--concurrency", type=int, default=3, help="sessions in flight at once")
    p.add_argument("--max-turns", type=int, default=3, help="turns per chat session at most")
    p.add_argument("--length-scale", type=float, default=0.25, help="factor on every workload length")
    p.add_argument("--reply-tokens", type=int, default=8, help="cap on generated tokens per turn")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    add_against_arguments(p)


@dataclass(frozen=True, slots=True)
class Session:
    system: np.ndarray              # token ids
    users: tuple[np.ndarray, ...]   # one per turn
    replies: tuple[int, ...]        # tokens to generate per turn


@dataclass(frozen=True, slots=True)
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    reply: tuple[int, ...]


def build_sessions(sessions: int, max_turns: int, scale: float, reply_cap: int, seed: int) -> list[Session]:
    """The chat workload's sessions, lengths scaled: system, then (user, reply) per turn."""
    from kvledger.bench.workloads import ChatConfig, chat, segment_tokens

    trace = chat(replace(ChatConfig(), seed=seed, sessions=sessions))
    last: dict[int, Any] = {}
    for r in trace.requests:   # a session's last request spells all its segments
        if r.session not in last or len(r.segments) > len(last[r.session].segments):
            last[r.session] = r

    def cut(seg) -> np.ndarray:
        return segment_tokens(seg)[: max(1, round(seg.length * scale))]

    out = []
    for s in sorted(last):
        segs = last[s].segments
        users = tuple(cut(seg) for seg in segs[1::2])[:max_turns]
        replies = tuple(max(1, min(round(seg.length * scale), reply_cap)) for seg in segs[2::2])[:max_turns]
        out.append(Session(cut(segs[0]), users, replies))
    return out


def run_session(url: str, model: str, index: int, s: Session) -> list[Turn]:
    from kvledger.bench.serve_client import stream_completion

    turns, prompt = [], s.system
    for t, (user, n) in enumerate(zip(s.users, s.replies)):
        prompt = np.concatenate([prompt, user])
        r = stream_completion(url, model, [int(x) for x in prompt], n)
        turns.append(Turn(index, t, r.prompt_tokens, r.cached_tokens, r.ttft_s, r.latency_s, r.token_ids))
        prompt = np.concatenate([prompt, np.asarray(r.token_ids, dtype=np.uint32)])
    return turns


def run_mode(mode: str, sessions: list[Session], args: argparse.Namespace, root: Path) -> tuple[list[Turn], float]:
    """One server (fresh data directory), the whole workload; (turns, wall seconds)."""
    from kvledger.engine.models.registry import cli_resolve
    from kvledger.util.serve_process import ServeProcess

    served = cli_resolve(args.model).name   # a path model is served under its stem
    extra = ["--no-cache"] if mode == "no_cache" else []
    server = ServeProcess(root / mode, *extra, "--max-concurrent-per-key", str(args.concurrency + 1),
                          model=args.model).start()
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            done = pool.map(lambda i: run_session(server.url, served, i, sessions[i]), range(len(sessions)))
            turns = [t for session in done for t in session]
        return turns, time.perf_counter() - t0
    finally:
        server.stop()


def summarize(turns: list[Turn], wall_s: float, warm: set[tuple[int, int]]) -> dict[str, Any]:
    def pct(xs: list[float], q: float) -> float | None:
        return round(float(np.percentile(xs, q)), 4) if xs else None

    by = defaultdict(list)
    for t in turns:
        by["warm" if (t.session, t.turn) in warm else "cold"].append(t.ttft_s)
    prompt = sum(t.prompt_tokens for t in turns)
    out = {"requests": len(turns), "wall_s": round(wall_s, 2), "requests_per_s": round(len(turns) / wall_s, 3),
           "ttft_p50_s": pct([t.ttft_s for t in turns], 50), "ttft_p99_s": pct([t.ttft_s for t in turns], 99),
           "prompt_tokens": prompt, "cached_tokens": sum(t.cached_tokens for t in turns),
           "token_hit_rate": round(sum(t.cached_tokens for t in turns) / prompt, 4) if prompt else 0.0}
    for kind in ("cold", "warm"):
        out[f"ttft_{kind}_p50_s"] = pct(by[kind], 50)
        out[f"ttft_{kind}_p99_s"] = pct(by[kind], 99)
        out[f"{kind}_requests"] = len(by[kind])
    return out


def first_turns(sessions: list[Session], runs: dict[str, tuple[list[Turn], float]]) -> list[dict[str, Any]]:
    """Each session's first turn, with the system prompt it starts with (numbered in session order) and how many
    sessions before it started with the same one: on a hybrid model, rule 4″ has the second such session keep the
    window at the system prompt's last whole block, and every later one read at least that far."""
    systems: dict[bytes, int] = {}
    seen: dict[int, int] = defaultdict(int)
    first = {mode: {t.session: t for t in turns if t.turn == 0} for mode, (turns, _) in runs.items()}
    out = []
    for i, s in enumerate(sessions):
        system = systems.setdefault(s.system.tobytes(), len(systems))
        cache, base = first["cache"][i], first["no_cache"][i]
        out.append({"session": i, "system": system, "system_tokens": len(s.system), "sessions_before": seen[system],
                    "cached_tokens": cache.cached_tokens, "ttft_s": round(cache.ttft_s, 4),
                    "no_cache_ttft_s": round(base.ttft_s, 4)})
        seen[system] += 1
    return out


def run(args: argparse.Namespace) -> int | None:
    from kvledger.util.output import CliError, emit_json

    if args.against == "vllm":
        return run_against_vllm(args)
    for name in ("sessions", "concurrency", "max_turns", "reply_tokens"):
        if getattr(args, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0")
    if not 0 < args.length_scale <= 1:
        raise CliError("--length-scale must lie in (0, 1]")
    sessions = build_sessions(args.sessions, args.max_turns, args.length_scale, args.reply_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-serve-") as tmp:
        runs = {mode: run_mode(mode, sessions, args, Path(tmp)) for mode in MODES}
    warm = {(t.session, t.turn) for t in runs["cache"][0] if t.cached_tokens > 0}
    result = {"bench": "serve", "model": args.model, "workload": _workload(args, sessions),
              **{mode: summarize(turns, wall, warm) for mode, (turns, wall) in runs.items()}}
    result["first_turns"] = first_turns(sessions, runs)
    replies = [{(t.session, t.turn): t.reply for t in turns} for turns, _ in runs.values()]
    result["same_replies"] = replies[0] == replies[1]
    result["ratios"] = _ratios(result["cache"], result["no_cache"])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        import json

        (out / "serve_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        emit_json(result)
    else:
        _table(result)


def _workload(args: argparse.Namespace, sessions: list[Session]) -> dict[str, Any]:
    return {"name": "chat", "seed": args.seed, "sessions": len(sessions), "concurrency": args.concurrency,
            "turns": sum(len(s.users) for s in sessions), "max_turns": args.max_turns,
            "length_scale": args.length_scale, "reply_tokens_cap": args.reply_tokens,
            "system_prompts_distinct": len({s.system.tobytes() for s in sessions})}


def _ratios(cache: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    return {"requests_per_s": ratio(cache["requests_per_s"], base["requests_per_s"]),
            "ttft_warm_p50_speedup": ratio(base["ttft_warm_p50_s"], cache["ttft_warm_p50_s"]),
            "ttft_p50_speedup": ratio(base["ttft_p50_s"], cache["ttft_p50_s"])}


def _table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w = res["workload"]
    t = Table(title=f"kvledger serve, {res['model']}: chat workload, {w['sessions']} sessions × ≤{w['max_turns']} "
                    f"turns ({w['turns']} requests), {w['concurrency']} at once, lengths × {w['length_scale']}")
    t.add_column("figure", justify="left")
    for mode in MODES:
        t.add_column(mode.replace("_", "-"), justify="right")
    for key in ("requests_per_s", "ttft_p50_s", "ttft_p99_s", "ttft_cold_p50_s", "ttft_cold_p99_s",
                "ttft_warm_p50_s", "ttft_warm_p99_s", "token_hit_rate", "prompt_tokens", "cached_tokens", "wall_s"):
        t.add_row(key, *(str(res[mode][key]) for mode in MODES))
    Console().print(t)
    Console().print(f"same replies with and without the cache: {res['same_replies']}; ratios: {res['ratios']}")
