"""`kvledger bench serve --against vllm --workload chat`: `kvledger serve` and `vllm serve` (prefix caching on)
under many multi-turn conversations at once, at equal cores and at each side's defaults, quiet and beside a
busy process, one server after the other in one run.

The workload (seeded, the same token ids for both sides): `--sessions` conversations of `--max-turns` turns, one
`--system-tokens` system prompt shared by all, `--user-tokens` tokens a user turn, `--output-tokens` greedy
tokens a reply (`ignore_eos`); a turn's prompt is the last turn's prompt + the reply the server gave (its token
ids, `return_token_ids`) + the next user turn. `--concurrency` conversations run at once, closed-loop, no think
time, every request streamed over /v1/completions with token ids.

Per setup, on each concurrency and burner setting:
- `vllm`: `vllm serve` at its defaults (on x86 it keeps one core for its frontend and computes on the rest),
  float32 weights as kvledger's (`--vllm-dtype`), block size 128;
- `kvledger-equal`: `kvledger serve --threads N`, N the cores vLLM computes on (all but one, at least 1);
- `kvledger-default`: `kvledger serve` at its defaults.
`--burner` `on` keeps one core busy (a process spinning in a loop) while a server is measured: a load
generator, a build, another service on the box. The figures (client side): TTFT p50 and p90, the gaps between
streamed chunks that carry tokens (inter-token) p50 and p99, requests per second, and of the first turns of the
conversations after the first two (each a new conversation on the shared system prompt, which the first two
stored) the TTFT p50 and the fewest cached tokens the server reported (vLLM: `--enable-prompt-tokens-details`);
the ratios are kvledger's
over vLLM's in the same concurrency and burner setting (under 1, kvledger is faster; requests per second: over
1). The first conversation's first turn is sent once before the load (a server's first call is not measured).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvledger.engine.threads import peer_environment
from kvledger.util.output import CliError
from kvledger.util.serve_process import spawn, terminate

SIDES = ("vllm", "kvledger-equal", "kvledger-default")
BURNER = "while True:\n    pass\n"


@dataclass(frozen=True, slots=True)
class ChatShape:
    sessions: int
    max_turns: int
    system_tokens: int
    user_tokens: int
    output_tokens: int
    seed: int

    def max_model_len(self) -> int:
        return self.system_tokens + self.max_turns * (self.user_tokens + self.output_tokens) + 64


@dataclass(frozen=True, slots=True)
class Streamed:
    """One request as the client saw it (seconds, perf_counter)."""

    ttft_s: float
    gaps_s: tuple[float, ...]    # between successive chunks that carried tokens
    token_ids: tuple[int, ...]
    cached_tokens: int


def add_chat_arguments(p: Any) -> None:
    p.add_argument("--workload", choices=["shapes", "chat"], default="shapes", help="with --against: `shapes` "
                   "(vllm bench serve, one request at a time) or `chat` (many multi-turn conversations at once, "
                   "equal cores and defaults, quiet and with a burner; default %(default)s)")
    p.add_argument("--chat-sessions", type=int, default=16, help="with --workload chat: conversations "
                   "(default %(default)s)")
    p.add_argument("--chat-turns", type=int, default=4, help="with --workload chat: turns a conversation "
                   "(default %(default)s)")
    p.add_argument("--system-tokens", type=int, default=1024, help="with --workload chat: the shared system "
                   "prompt's tokens (default %(default)s)")
    p.add_argument("--user-tokens", type=int, default=128, help="with --workload chat: tokens a user turn "
                   "(default %(default)s)")
    p.add_argument("--chat-concurrency", default="2,8", help="with --workload chat: conversations at once, a "
                   "comma-separated list (default %(default)s)")
    p.add_argument("--burner", choices=["off", "on", "both"], default="both", help="with --workload chat: one "
                   "core kept busy while a server is measured (default %(default)s)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"with --workload chat: which of {', '.join(SIDES)} "
                   "(default all)")


def chat_shape(args: Any) -> ChatShape:
    shape = ChatShape(args.chat_sessions, args.chat_turns, args.system_tokens, args.user_tokens,
                      args.output_tokens, args.seed)
    if not (1 <= shape.sessions <= 1000 and 1 <= shape.max_turns <= 64 and 1 <= shape.system_tokens <= 30_000
            and 1 <= shape.user_tokens <= 30_000 and 1 <= shape.output_tokens <= 4096):
        raise CliError("--chat-sessions must lie in [1, 1000], --chat-turns in [1, 64], --system-tokens and "
                       "--user-tokens in [1, 30000], --output-tokens in [1, 4096]")
    return shape


def prompts(shape: ChatShape, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each conversation's user turns, seeded token ids away from the vocabulary's ends
    (where the special tokens are)."""
    rng = np.random.default_rng(shape.seed)
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab * 3 // 4)
    system = rng.integers(lo, hi, shape.system_tokens).tolist()
    users = [[rng.integers(lo, hi, shape.user_tokens).tolist() for _ in range(shape.max_turns)]
             for _ in range(shape.sessions)]
    return system, users


def stream(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 900.0) -> Streamed:
    """One streamed greedy completion of token ids, with its token ids back (`return_token_ids`, vLLM's field;
    kvledger sends them always) and the usage's cached tokens (0 where the server does not say)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       "return_token_ids": True})
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise CliError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
        times, ids, usage = [], [], None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            got = [t for c in chunk.get("choices") or () for t in c.get("token_ids") or ()]
            if got:
                times.append(time.perf_counter())
                ids.extend(got)
            usage = chunk.get("usage") or usage
    finally:
        conn.close()
    if not times or usage is None:
        raise CliError(f"{url}: the stream ended without tokens or usage")
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return Streamed(times[0] - t0, tuple(np.diff(times).tolist()), tuple(ids), int(cached))


def converse(url: str, model: str, shape: ChatShape, system: list[int], users: list[list[int]]) -> list[Streamed]:
    prompt, out = list(system), []
    for user in users:
        prompt += user
        r = stream(url, model, prompt, shape.output_tokens)
        out.append(r)
        prompt += list(r.token_ids)
    return out


def drive(url: str, model: str, shape: ChatShape, concurrency: int, vocab: int) -> dict[str, Any]:
    """The whole workload against one server; its figures."""
    system, users = prompts(shape, vocab)
    stream(url, model, system + users[0][0], shape.output_tokens)   # warm-up: the first call is not measured
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        convs = list(pool.map(lambda u: converse(url, model, shape, system, u), users))
    wall = time.perf_counter() - t0
    turns = [t for conv in convs for t in conv]
    ttft = [t.ttft_s for t in turns]
    gaps = [g for t in turns for g in t.gaps_s]
    later_firsts = [conv[0] for conv in convs[2:]]   # new conversations after the first two: the shared prefix's hits

    def q(xs: list[float], p: float) -> float | None:
        return round(float(np.percentile(xs, p)) * 1000, 1) if xs else None

    return {"requests": len(turns), "wall_s": round(wall, 2), "requests_per_s": round(len(turns) / wall, 3),
            "ttft_p50_ms": q(ttft, 50), "ttft_p90_ms": q(ttft, 90), "inter_token_p50_ms": q(gaps, 50),
            "inter_token_p99_ms": q(gaps, 99), "cached_tokens": sum(t.cached_tokens for t in turns),
            "first_turn_ttft_p50_ms": q([t.ttft_s for t in later_firsts], 50),
            "first_turn_cached_min": min((t.cached_tokens for t in later_firsts), default=None)}


@contextlib.contextmanager
def burning(on: bool) -> Iterator[None]:
    """One process spinning on a core (the kernel places it) while the block runs."""
    proc = spawn([sys.executable, "-c", BURNER]) if on else None
    try:
        yield
    finally:
        terminate(proc, 5)


def compute_cores() -> int:
    """The cores vLLM computes on at its defaults on x86: all this process may use but one, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def server_command(side: str, args: Any, name: str, folder: Path, port: int, work: Path,
                   shape: ChatShape) -> tuple[list[str], dict[str, str]]:
    if side == "vllm":
        cmd = [args.vllm_python, "-m", "kvledger.integrations.vllm.serve", str(folder), "--served-model-name", name,
               "--host", "127.0.0.1", "--port", str(port), "--block-size", "128", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--dtype", args.vllm_dtype, "--max-model-len",
               str(shape.max_model_len())]
        return cmd, {**peer_environment(), "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd = [sys.executable, "-m", "kvledger", "serve", "--model", name, "--port", str(port), "--data-dir",
           str(work / "data"), "--no-trace", "--max-concurrent-per-key", "1000"]
    if side == "kvledger-equal":
        cmd += ["--threads", str(compute_cores())]
    return cmd, os.environ.copy()


def wait_ready(proc: subprocess.Popen, url: str, side: str, log: Path, timeout_s: float = 900.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CliError(f"{side} exited while starting (log: {log})")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise CliError(f"{side} did not start within {timeout_s:.0f} s (log: {log})")


def run_chat(args: Any, name: str, folder: Path, vocab: int, work: Path) -> dict[str, Any]:
    from kvledger.util.serve_process import free_port

    shape = chat_shape(args)
    try:
        levels = sorted({int(c) for c in str(args.chat_concurrency).split(",")})
    except ValueError:
        raise CliError(f"--chat-concurrency {args.chat_concurrency}: comma-separated integers") from None
    sides = [s.strip() for s in str(args.sides).split(",")]
    if not levels or levels[0] < 1 or any(s not in SIDES for s in sides):
        raise CliError(f"--chat-concurrency: integers ≥ 1; --sides: some of {', '.join(SIDES)}")
    burners = {"off": [False], "on": [True], "both": [False, True]}[args.burner]
    runs = []
    for burner in burners:
        for side in sides:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            here = work / f"{side}-{'burner' if burner else 'quiet'}"
            here.mkdir(parents=True)
            cmd, env = server_command(side, args, name, folder, port, here, shape)
            log = here / "server.log"
            with open(log, "ab") as f:
                proc = spawn(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            try:
                wait_ready(proc, url, side, log)
                for c in levels:
                    with burning(burner):
                        figures = drive(url, name, shape, c, vocab)
                    runs.append({"side": side, "burner": burner, "concurrency": c, **figures})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            finally:
                terminate(proc, 60)
    return {"workload": "chat", "model": name, "shape": {f: getattr(shape, f) for f in ChatShape.__slots__},
            "cores": len(os.sched_getaffinity(0)), "kvledger_equal_threads": compute_cores(),
            "vllm_dtype": args.vllm_dtype, "runs": runs, "ratios": ratios(runs)}


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvledger's figures over vLLM's in the same burner and concurrency setting."""
    peer = {(r["burner"], r["concurrency"]): r for r in runs if r["side"] == "vllm"}
    out = []
    for r in runs:
        v = peer.get((r["burner"], r["concurrency"]))
        if r["side"] == "vllm" or v is None:
            continue
        row = {"side": r["side"], "burner": r["burner"], "concurrency": r["concurrency"]}
        for key in ("ttft_p50_ms", "ttft_p90_ms", "inter_token_p50_ms", "inter_token_p99_ms", "requests_per_s",
                    "first_turn_ttft_p50_ms"):
            row[key] = round(r[key] / v[key], 3) if r.get(key) and v.get(key) else None
        out.append(row)
    return out


def print_chat(result: dict[str, Any]) -> None:
    s = result["shape"]
    print(f"{result['model']}: {s['sessions']} conversations × {s['max_turns']} turns, {s['system_tokens']}-token "
          f"shared system prompt, {s['user_tokens']}-token user turns, {s['output_tokens']} output tokens; "
          f"{result['cores']} cores, kvledger-equal at {result['kvledger_equal_threads']} threads")
    print(f"{'side':<17} {'burner':<6} {'conc':>4} {'TTFT p50/p90 ms':>18} {'inter-token p50/p99 ms':>23} {'req/s':>7}")
    for r in result["runs"]:
        print(f"{r['side']:<17} {'on' if r['burner'] else 'off':<6} {r['concurrency']:>4} "
              f"{r['ttft_p50_ms']:>8.0f}/{r['ttft_p90_ms']:<9.0f} {r['inter_token_p50_ms']:>10.0f}/"
              f"{r['inter_token_p99_ms']:<12.0f} {r['requests_per_s']:>7.3f}")
    for r in result["ratios"]:
        print(f"{r['side']} / vllm, burner {'on' if r['burner'] else 'off'}, concurrency {r['concurrency']}: "
              + ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("side", "burner", "concurrency")))
