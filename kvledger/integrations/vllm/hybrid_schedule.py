"""The request schedule of `kvledger bench vllm --model gemma3-270m`: who is asked what, in which order.

Two phases, each a set of vLLM processes alive together that take one request at a time:

| phase  | processes (role)                                   | per prompt (size L, repeat r)                      |
|--------|----------------------------------------------------|----------------------------------------------------|
| stored | `vllm` (no connector, its own prefix cache on),    | every role: cold (max_tokens 1; the connectors     |
|        | `kvledger`, `mooncake` (prefix cache off),         | store); then the same-process roles (`vllm`, and   |
|        | `simple_cpu_offload_disk` (prefix cache on: it     | `simple_cpu_offload_disk` after vLLM's own cache   |
|        | requires it)                                       | is emptied) the same prompt again: hit             |
| fresh  | `kvledger`, `mooncake`: new processes on the same  | every role: hit (max_tokens 1), vLLM's own cache   |
|        | stores, after the stored phase's are gone; `vllm`  | cold (off) in the new ones; `vllm` hits its own    |
|        | (the same process, still alive)                    | cache again, beside them (`phase` "fresh"; first a |
|        |                                                    | `refill` of the prompt, which its LRU may have     |
|        |                                                    | evicted since, not counted)                        |

The roles' order rotates by one each repeat. At r = 0 of each size, the greedy check: the hitting roles
ask for 16 tokens (`check_hit`), and `vllm` computes the same prompt cold again under another cache
salt (`check_cold`: the reference tokens). Prompts of different (L, r) share no block (`variant`).
A sample is a dict: role, phase (stored | fresh), prompt_tokens, repeat, kind (cold | hit |
check_cold | check_hit), seconds (wall time of the request: the TTFT at max_tokens 1), cpu_s (the
engine's), cached (vLLM's num_cached_tokens), tokens (the generated ids).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

CHECK_TOKENS = 16
CHECK_SALT = "greedy-check"   # another namespace and prefix-cache hash: the same tokens computed cold
WARMUP_TOKENS = 512
TIMEOUT_S = 1800.0
PLAIN = "vllm"
SAME_PROCESS = (PLAIN, "simple_cpu_offload_disk")   # roles whose hit is asked of the storing process

PromptOf = Callable[[int, int], list[int]]


class Engine(Protocol):
    def generate(self, prompt: list[int], *, max_tokens: int = ..., salt: str | None = ...,
                 timeout_s: float = ...) -> dict[str, Any]: ...
    def cpu_s(self) -> float: ...
    def reset_prefix_cache(self) -> bool: ...


def variant(tokens: int, repeat: int) -> int:
    """The prompt variant of size `tokens`, repeat `repeat`: distinct for every pair (and from the warm-ups)."""
    return tokens * 10 + repeat + 1


def rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def ask(engines: Mapping[str, Engine], role: str, prompt: list[int], kind: str, repeat: int,
        *, max_tokens: int = 1, salt: str | None = None, phase: str = "stored") -> dict[str, Any]:
    """One request, as a sample."""
    engine = engines[role]
    before = engine.cpu_s()
    out = engine.generate(prompt, max_tokens=max_tokens, salt=salt, timeout_s=TIMEOUT_S)
    return {"role": role, "phase": phase, "prompt_tokens": len(prompt), "repeat": repeat, "kind": kind,
            "seconds": out["seconds"], "cpu_s": engine.cpu_s() - before, "cached": out["num_cached_tokens"],
            "tokens": out["tokens"]}


def warm_up(engines: Mapping[str, Engine], prompt_of: PromptOf, variant_id: int) -> None:
    """Kernel set-up on a short prompt of its own, twice (not counted): the second time is a hit, and a
    process's first prefill after a cached prefix took 1.8 s against 0.3–0.5 s for the next ones (a
    640-token prompt, kvledger's hit in a fresh process, its loads done 0.03 s into each)."""
    for engine in engines.values():
        for _ in range(2):
            engine.generate(prompt_of(WARMUP_TOKENS, variant_id), max_tokens=1, timeout_s=TIMEOUT_S)


def stored_phase(engines: Mapping[str, Engine], sizes: list[int], repeat: int, prompt_of: PromptOf,
                 after_size: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Cold (and the same-process roles' hits) for every size and repeat; `after_size(L)` after each size."""
    samples: list[dict[str, Any]] = []
    for tokens in sizes:
        for r in range(repeat):
            prompt, names = prompt_of(tokens, variant(tokens, r)), rotated(list(engines), r)
            samples += [ask(engines, name, prompt, "cold", r) for name in names]
            hitters = [name for name in names if name in SAME_PROCESS]
            for name in hitters:
                if name != PLAIN:
                    engines[name].reset_prefix_cache()
                samples.append(ask(engines, name, prompt, "hit", r))
            if r == 0:
                samples += check(engines, hitters, prompt, r)
                if PLAIN in engines:
                    samples.append(ask(engines, PLAIN, prompt, "check_cold", r, max_tokens=CHECK_TOKENS,
                                       salt=CHECK_SALT))
        if after_size is not None:
            after_size(tokens)
    return samples


def check(engines: Mapping[str, Engine], names: list[str], prompt: list[int], r: int) -> list[dict[str, Any]]:
    """The greedy check's hits: 16 tokens from each role (a hit again: the 1-token hit did not change the store)."""
    out = []
    for name in names:
        if name != PLAIN and name in SAME_PROCESS:
            engines[name].reset_prefix_cache()
        out.append(ask(engines, name, prompt, "check_hit", r, max_tokens=CHECK_TOKENS))
    return out


def fresh_phase(engines: Mapping[str, Engine], sizes: list[int], repeat: int,
                prompt_of: PromptOf) -> list[dict[str, Any]]:
    """Hits of the stored prompts in processes that never computed them, beside `vllm`'s hits of its own
    cache (the same moment's floor); the greedy check of the new processes at r = 0."""
    samples: list[dict[str, Any]] = []
    for tokens in sizes:
        for r in range(repeat):
            prompt, names = prompt_of(tokens, variant(tokens, r)), rotated(list(engines), r)
            if PLAIN in engines:   # its cache may have evicted the prompt since: put it back (not counted)
                samples.append(ask(engines, PLAIN, prompt, "refill", r, phase="fresh"))
            samples += [ask(engines, name, prompt, "hit", r, phase="fresh") for name in names]
            if r == 0:
                samples += [s | {"phase": "fresh"} for s in check(engines, [n for n in names if n != PLAIN],
                                                                    prompt, r)]
    return samples
