"""kvledger: a shared, persistent KV-cache tier for LLM serving.

The public names of the contract (DESIGN.md) live in `kvledger.core` and are re-exported here.
"""

from kvledger.core import (
    HitDecision,
    HitKind,
    LayerKind,
    ModelSpec,
    chain_keys,
    decide_hit,
    decode_replica_positions,
    decode_store_position,
    diff_prompts,
    plan,
    prefill_store_positions,
)

__version__ = "0.1.0"

__all__ = [
    "HitDecision", "HitKind", "LayerKind", "ModelSpec", "chain_keys", "decide_hit", "decode_replica_positions",
    "decode_store_position", "diff_prompts", "plan", "prefill_store_positions",
]
