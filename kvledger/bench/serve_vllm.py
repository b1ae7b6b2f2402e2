"""`kvledger bench serve --against vllm`: `kvledger serve` and `vllm serve` (prefix caching on) on the same
model, one after the other, each driven by vLLM's own client, `vllm bench serve`, with the same shapes.

`--workload chat` runs many multi-turn conversations at once instead (serve_chat_vllm.py).

The shapes, run in this order on each server, `max_concurrency` 1 (one request after the other), greedy,
`ignore_eos`, `--output-tokens` tokens each:
- `unshared`: `--requests` prompts of `--prefix + --suffix` random tokens: every one cold;
- `shared`: `--requests` prompts sharing their first `--prefix` tokens (vLLM's random dataset,
  `--random-prefix-len`): the first is cold, the rest hit on the prefix;
- `restart`: the server is stopped and started again on the same data folder, then the prompts of `shared` are
  sent again (the same seed: the same prompts): kvledger finds them on its store, vLLM's cache in memory is
  gone. Its first request is the figure.

After each start, 2 requests of the same sizes on prompts of their own warm the server up (its first calls
are not what the shapes measure).

Per side: TTFT p50 and p99 of the cold requests (`unshared`), of the hits (`shared` but its first), the first
request after the restart, and TPOT p50 and p99 (every request: the mean gap between its output tokens). The
ratios are kvledger over vLLM (`hit_ttft_ratio`, `cold_ttft_ratio`, `tpot_ratio`): under 1, kvledger is faster.

vLLM runs from `.venv-vllm` (`make vllm-venv`), through `kvledger.integrations.vllm.serve` (the CPU wheel's
launcher); both servers use every core the process may use (vLLM reserves none for its frontend here), vLLM
with its defaults but the KV cache space and `--vllm-dtype` (float32, as the reference engine's weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.bench.serve_chat_vllm import add_chat_arguments, print_chat, run_chat
from kvledger.engine.threads import peer_environment
from kvledger.util.output import CliError, emit_json
from kvledger.util.serve_process import free_port, spawn, terminate

VLLM_PYTHON = Path(".venv-vllm/bin/python")
START_TIMEOUT_S = 900.0
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}   # every core computes
CLIENT = ("import sys, kvledger.integrations.vllm.serve; from vllm.entrypoints.cli.main import main; "
          "sys.argv = ['vllm', 'bench', 'serve', *sys.argv[1:]]; main()")


def add_against_arguments(p: Any) -> None:
    p.add_argument("--against", choices=["vllm"], default=None, help="instead of the chat workload: kvledger serve "
                   "and vllm serve in turn under vLLM's `vllm bench serve` client, same shapes (needs .venv-vllm)")
    p.add_argument("--prefix", type=int, default=2048, help="with --against: tokens the shared prompts share "
                   "(default %(default)s)")
    p.add_argument("--suffix", type=int, default=256, help="with --against: tokens after the prefix (default "
                   "%(default)s)")
    p.add_argument("--output-tokens", type=int, default=16, help="with --against: tokens per reply (default "
                   "%(default)s)")
    p.add_argument("--requests", type=int, default=6, help="with --against: requests per shape (default "
                   "%(default)s)")
    p.add_argument("--vllm-dtype", default="float32", help="with --against: vLLM's --dtype (default %(default)s: "
                   "the reference engine's weights; bf16 runs emulated on a CPU without AVX-512 BF16)")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="with --against: the Python of a virtualenv with "
                   "vLLM and kvledger (default %(default)s)")
    add_chat_arguments(p)


def run_against_vllm(args: Any) -> int:
    from kvledger.engine.models.registry import resolve

    if not Path(args.vllm_python).exists():
        raise CliError(f"--vllm-python {args.vllm_python} does not exist (make vllm-venv builds .venv-vllm)")
    if not (1 <= args.prefix <= 30_000 and 1 <= args.suffix <= 30_000 and 1 <= args.output_tokens <= 4096
            and 2 <= args.requests <= 1000):
        raise CliError("--prefix and --suffix must lie in [1, 30000], --output-tokens in [1, 4096], --requests in "
                       "[2, 1000]")
    try:
        entry = resolve(args.model)
        folder = entry.weights.folder()
    except (ValueError, AttributeError) as e:
        raise CliError(f"--model {args.model}: {e}") from None
    if args.workload == "chat":
        vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        with tempfile.TemporaryDirectory() as tmp:
            chat = run_chat(args, entry.name, folder, vocab, Path(tmp))
        if args.json:
            emit_json(chat)
        else:
            print_chat(chat)
        return 0
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("kvledger", "vllm"):
            sides[side] = _side(side, args, entry.name, folder, Path(tmp) / side)
    result = _summary(args, entry.name, sides)
    if args.json:
        emit_json(result)
    else:
        _print_table(result)
    return 0


def _side(side: str, args: Any, name: str, folder: Path, work: Path) -> dict[str, Any]:
    """The three shapes on one server; each shape's per-request TTFTs (s) and TPOTs (s)."""
    work.mkdir(parents=True)
    total = args.prefix + args.suffix
    shapes = {"unshared": dict(prefix=0, input=total, n=args.requests, seed=1),
              "shared": dict(prefix=args.prefix, input=args.suffix, n=args.requests, seed=2)}
    out: dict[str, Any] = {}
    server = _Server(side, args, name, folder, work)
    try:
        _start_warm(server, args, name, folder, work)
        for shape, s in shapes.items():
            out[shape] = _client(args, name, folder, server.url, work / f"{shape}.json", **s)
        server.stop()
        _start_warm(server, args, name, folder, work)
        out["restart"] = _client(args, name, folder, server.url, work / "restart.json", **shapes["shared"])
    finally:
        server.stop()
    return out


def _start_warm(server: _Server, args: Any, name: str, folder: Path, work: Path) -> None:
    """Start, then 2 requests of the measured sizes on prompts of their own (seed 99): a server's first calls
    (kernel selection, graph capture, allocations) are not what the shapes measure."""
    server.start()
    _client(args, name, folder, server.url, work / "warmup.json", prefix=args.prefix, input=args.suffix, n=2,
            seed=99)


class _Server:
    def __init__(self, side: str, args: Any, name: str, folder: Path, work: Path) -> None:
        self.side, self.args, self.name, self.folder, self.work = side, args, name, folder, work
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        if self.side == "kvledger":
            cmd = [sys.executable, "-m", "kvledger", "serve", "--model", self.name, "--port", str(self.port),
                   "--data-dir", str(self.work / "data"), "--no-trace"]
            env = os.environ.copy()
        else:
            cmd = [self.args.vllm_python, "-m", "kvledger.integrations.vllm.serve", str(self.folder),
                   "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(self.port),
                   "--block-size", "128", "--enable-prefix-caching", "--dtype", self.args.vllm_dtype,
                   "--max-model-len",
                   str(self.args.prefix + self.args.suffix + self.args.output_tokens + 64)]
            env = {**peer_environment(), **VLLM_ENV}
        with open(self.work / f"{self.side}.log", "ab") as log:
            self.proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CliError(f"{self.side} serve exited while starting (log: {self.work / self.side}.log)")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise CliError(f"{self.side} serve did not start within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        terminate(self.proc, 60)
        self.proc = None


def _client(args: Any, name: str, folder: Path, url: str, result: Path, *, prefix: int, input: int, n: int,
            seed: int) -> dict[str, list[float]]:
    """`vllm bench serve` once; per request, in order: TTFT and TPOT in seconds."""
    cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", name, "--tokenizer", str(folder), "--dataset-name", "random", "--random-input-len", str(input),
           "--random-prefix-len", str(prefix), "--random-output-len", str(args.output_tokens), "--num-prompts",
           str(n), "--max-concurrency", "1", "--ignore-eos", "--ready-check-timeout-sec", "0", "--seed", str(seed),
           "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename",
           result.name, "--disable-tqdm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**peer_environment(), **VLLM_ENV})
    if r.returncode != 0 or not result.exists():
        tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
        raise CliError(f"vllm bench serve failed ({r.returncode}): {' | '.join(tail)}")
    d = json.loads(result.read_text())
    if d.get("completed") != n:
        raise CliError(f"vllm bench serve: {d.get('completed')} of {n} requests completed: {d.get('errors')}")
    tpots = [float(np.mean(itl)) for itl in d["itls"]]
    return {"ttft_s": [float(t) for t in d["ttfts"]], "tpot_s": tpots}


def _pct(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(xs, 50)) * 1000, 1), "p99_ms": round(float(np.percentile(xs, 99))
                                                                                       * 1000, 1), "n": len(xs)}


def _summary(args: Any, name: str, sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    figures = {}
    for side, s in sides.items():
        tpots = [t for shape in s.values() for t in shape["tpot_s"]]
        figures[side] = {"cold_ttft": _pct(s["unshared"]["ttft_s"]), "hit_ttft": _pct(s["shared"]["ttft_s"][1:]),
                         "first_shared_ttft_ms": round(s["shared"]["ttft_s"][0] * 1000, 1),
                         "restart_first_ttft_ms": round(s["restart"]["ttft_s"][0] * 1000, 1), "tpot": _pct(tpots)}
    k, v = figures["kvledger"], figures["vllm"]
    return {"model": name, "prefix": args.prefix, "suffix": args.suffix, "output_tokens": args.output_tokens,
            "requests": args.requests, "cores": len(os.sched_getaffinity(0)), "sides": figures,
            "hit_ttft_ratio": round(k["hit_ttft"]["p50_ms"] / v["hit_ttft"]["p50_ms"], 3),
            "cold_ttft_ratio": round(k["cold_ttft"]["p50_ms"] / v["cold_ttft"]["p50_ms"], 3),
            "tpot_ratio": round(k["tpot"]["p50_ms"] / v["tpot"]["p50_ms"], 3),
            "restart_ttft_ratio": round(k["restart_first_ttft_ms"] / v["restart_first_ttft_ms"], 3)}


def _print_table(r: dict[str, Any]) -> None:
    print(f"{r['model']}: {r['prefix']}+{r['suffix']}-token prompts, {r['output_tokens']} output tokens, "
          f"{r['requests']} requests per shape, vllm bench serve, one at a time")
    print(f"{'side':<9} {'cold TTFT p50/p99 ms':>22} {'hit TTFT p50/p99 ms':>22} {'after restart ms':>17} "
          f"{'TPOT p50/p99 ms':>18}")
    for side, f in r["sides"].items():
        print(f"{side:<9} {f['cold_ttft']['p50_ms']:>11.0f}/{f['cold_ttft']['p99_ms']:<10.0f} "
              f"{f['hit_ttft']['p50_ms']:>11.0f}/{f['hit_ttft']['p99_ms']:<10.0f} {f['restart_first_ttft_ms']:>17.0f} "
              f"{f['tpot']['p50_ms']:>9.1f}/{f['tpot']['p99_ms']:<8.1f}")
    print(f"kvledger / vLLM: hit TTFT {r['hit_ttft_ratio']}, cold TTFT {r['cold_ttft_ratio']}, TPOT {r['tpot_ratio']}, "
          f"first after a restart {r['restart_ttft_ratio']}")
