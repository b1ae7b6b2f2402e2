"""kvledger: a shared, persistent KV-cache tier for LLM serving.

The public names of the contract (DESIGN.md) live in `kvledger.core` and are re-exported here,
imported on first use (PEP 562), so `import kvledger` itself costs nothing: a CLI that is
interrupted a few milliseconds after its start still exits cleanly.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "HitDecision", "HitKind", "LayerKind", "ModelSpec", "chain_keys", "decide_hit", "decode_replica_positions",
    "decode_store_position", "diff_prompts", "plan", "prefill_store_positions",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvledger.core"), name)
    raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
