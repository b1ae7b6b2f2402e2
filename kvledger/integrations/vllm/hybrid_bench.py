"""`kvledger bench vllm --model gemma3-270m`: a hybrid model under vLLM (its hybrid KV cache manager on),
kvledger's connector side by side with vLLM's own prefix cache, SimpleCPUOffloadConnector (`disk`)
and MooncakeStoreConnector, in one run.

Every process runs Gemma 3 270M from the registry's Hugging Face folder, float32 (as the Gemma test:
a hit computes its last tokens in a batch of another shape than a cold prefill), prefill in chunks
of `--chunk` tokens (default 4,096: with 8,192 a process held 5.5 GiB, and the kernel's OOM killer ended
one of four started together on a 23 GiB machine). The schedule is `hybrid_schedule`'s, the figures
`hybrid_report`'s. A peer that cannot start is reported by the line its failure raised, not by a
figure. Mooncake's master and pool run on loopback for the length of the run (`peers.MooncakeLoopback`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvledger.integrations.vllm import hybrid_report, hybrid_schedule
from kvledger.integrations.vllm.peers import MooncakeLoopback, bytes_under, failure_line

KV_CACHE_GIB = "1"  # vLLM's CPU KV cache per process: a 32K prompt needs ≈ 0.35 GiB of it in 4K chunks
SETTLE_S = 3.0   # after a size's last cold: the connectors' saves land before the bytes are read
DTYPE, DTYPE_BYTES = "float32", 4
PEERS = ("mooncake", "simple_cpu_offload_disk")   # `--peers`' names, the report's roles


def all_layers_bytes_per_token(folder: Path, dtype_bytes: int = DTYPE_BYTES) -> int:
    """K and V of every layer for one token, from the model's config.json (Gemma 3 270M, float32: 36,864 B)."""
    config = json.loads((folder / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def start_each(engines: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Start several engines at once; those that fail are returned by name with their failure line
    (and the exit status, when the process died: -9 is a kill, e.g. the kernel's OOM killer)."""
    from kvledger.integrations.vllm.client import EngineError

    started: dict[str, Any] = {}
    failures: dict[str, str] = {}

    def enter(name: str) -> None:
        engine = engines[name]
        try:
            started[name] = engine.__enter__()
        except (EngineError, AssertionError) as e:
            code = engine.proc.poll() if engine.proc is not None else None
            line = failure_line(list(engine.log)) if engine.log else str(e).splitlines()[0]
            failures[name] = line if code is None else f"exit status {code}: {line}"
            engine.__exit__(None, None, None)

    threads = [threading.Thread(target=enter, args=(name,)) for name in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {name: started[name] for name in engines if name in started}, failures


def start_required(engines: dict[str, Any], required: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """`start_each`, but a failure of a `required` engine (the baseline, kvledger) ends the run."""
    from kvledger.integrations.vllm.client import EngineError

    started, failures = start_each(engines)
    missing = [name for name in required if name in failures]
    if missing:
        close(started)
        raise EngineError("; ".join(f"{name} did not start: {failures[name]}" for name in missing))
    return started, failures


def close(engines: dict[str, Any]) -> None:
    for engine in engines.values():
        engine.__exit__(None, None, None)


def run(args: Any) -> dict[str, Any]:
    from kvledger.engine.models import registry
    from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess
    from kvledger.integrations.vllm.prompts import long_prompt

    entry = registry.resolve(args.model)
    folder = entry.weights.folder()
    sizes, repeat = args.sizes, args.repeat
    base = Path(tempfile.mkdtemp(prefix="kvledger-bench-vllm-hybrid-", dir=args.dir))
    context = json.loads((folder / "config.json").read_text()).get("max_position_embeddings", max(sizes) + 1024)
    if max(sizes) + hybrid_schedule.CHECK_TOKENS > context:
        raise ValueError(f"--sizes: a {max(sizes)}-token prompt and {hybrid_schedule.CHECK_TOKENS} tokens exceed the "
                         f"model's {context}-token context")
    common = {"model": str(folder), "dtype": DTYPE, "max_model_len": min(max(sizes) + 1024, context),
              "max_num_batched_tokens": args.chunk}
    env = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    kvl = {**common, "connector": "kvledger", "store": str(base / "kvledger"), "model_name": entry.name,
           "events": str(base / "kvledger-events.jsonl")}

    def prompt_of(tokens: int, variant: int) -> list[int]:
        return long_prompt(tokens, variant, model=entry.name, bos=2)

    failures: dict[str, str] = {}
    held: dict[int, dict[str, int]] = {}
    samples: list[dict[str, Any]] = []
    start_s: dict[str, dict[str, float]] = {"stored": {}, "fresh": {}}
    hybrid: dict[str, bool] = {}
    load_before = os.getloadavg()[0]
    mooncake = MooncakeLoopback(bin_dir=VLLM_PYTHON.parent, work=base / "mooncake")
    try:
        try:
            mooncake.__enter__()
        except RuntimeError as e:
            failures["mooncake"] = str(e)
        mc_env = {**env, "MOONCAKE_CONFIG_PATH": str(mooncake.config_path)}
        first = {"vllm": VllmProcess({**common, "connector": None, "prefix_caching": True}, env=env),
                 "kvledger": VllmProcess(kvl, env=env)}
        if "mooncake" not in failures:
            first["mooncake"] = VllmProcess({**common, "connector": "mooncake"}, env=mc_env)
        if "mooncake" not in args.peers:
            first.pop("mooncake", None)
        engines: dict[str, Any] = {}
        if "simple_cpu_offload_disk" in args.peers:   # alone first: on a CPU it fails at start, in seconds
            engines, failed = start_each({"simple_cpu_offload_disk": VllmProcess(
                {**common, "connector": "simple-disk", "prefix_caching": True, "store": str(base / "simple")},
                env=env)})
            failures.update(failed)
        more, failed = start_required(first, ("vllm", "kvledger"))
        engines.update(more)
        failures.update(failed)
        try:
            start_s["stored"] = {n: e.start_s for n, e in engines.items()}
            hybrid.update({n: e.hybrid_kv_cache_manager for n, e in engines.items()})
            hybrid_schedule.warm_up(engines, prompt_of, 10_000)
            before = [_held(base, mooncake if "mooncake" in engines else None)]

            def after_size(tokens: int) -> None:
                time.sleep(SETTLE_S)
                now = _held(base, mooncake if "mooncake" in engines else None)
                held[tokens] = {k: now[k] - before[0][k] for k in now}
                before[0] = now

            samples += hybrid_schedule.stored_phase(engines, sizes, repeat, prompt_of, after_size)
        finally:   # vLLM alone stays: its own hits are asked again beside the fresh processes'
            close({n: e for n, e in engines.items() if n != "vllm"})
        again = {"kvledger": VllmProcess(kvl, env=env)}
        if "mooncake" in engines:
            again["mooncake"] = VllmProcess({**common, "connector": "mooncake"}, env=mc_env)
        try:
            fresh, failed = start_required(again, ("kvledger",))
        except BaseException:
            close({"vllm": engines["vllm"]})
            raise
        failures.update({f"{n}_fresh": line for n, line in failed.items()})
        try:
            start_s["fresh"] = {n: e.start_s for n, e in fresh.items()}
            hybrid.update({f"{n}_fresh": e.hybrid_kv_cache_manager for n, e in fresh.items()})
            hybrid_schedule.warm_up(fresh, prompt_of, 10_001)
            samples += hybrid_schedule.fresh_phase({"vllm": engines["vllm"], **fresh}, sizes, repeat, prompt_of)
        finally:
            close({"vllm": engines["vllm"], **fresh})
        events = _events(base / "kvledger-events.jsonl")
    finally:
        mooncake.__exit__(None, None, None)
        shutil.rmtree(base, ignore_errors=True)
    roles = ["vllm", "kvledger", *(peer for peer in PEERS if peer in args.peers)]
    report = hybrid_report.summarize(samples, sizes, repeat, roles, failures, held, all_layers_bytes_per_token(folder),
                                     events)
    return {"bench": "vllm", "model": f"{entry.name} ({DTYPE}, vLLM CPU, hybrid KV cache manager on)",
            "sizes": sizes, "repeat": repeat, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "hybrid_kv_cache_manager": hybrid, "start_s": start_s,
            "kvledger_saved_blocks": sum(e["ok"] for e in events if e["event"] == "save"),
            "conditions": {"dtype": DTYPE, "prefill_chunk": args.chunk, "kv_cache_gib": float(KV_CACHE_GIB),
                           "block": hybrid_report.BLOCK, "greedy_check_tokens": hybrid_schedule.CHECK_TOKENS},
            **report, "samples": samples}


def _held(base: Path, mooncake: MooncakeLoopback | None) -> dict[str, int]:
    on_disk = bytes_under(base / "kvledger")
    out = {"kvledger_blocks": on_disk["blocks"], "kvledger_snapshots": on_disk["snapshots"]}
    if mooncake is not None:
        out["mooncake"] = mooncake.allocated_bytes()
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    """kvledger's connector event log (one JSON object a line; warm-ups included)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
