"""Pure logic of kvledger: no I/O, no network, no torch; imports nothing of the other packages."""

from kvledger.core.diff import PromptDiff, diff_prompts
from kvledger.core.hit import (
    HitDecision,
    HitKind,
    MESSAGE_SNAPSHOTS,
    HitLookup,
    SnapshotLookup,
    block_reach,
    blocks_spanned,
    cap_blocks,
    check_decision,
    checkpoint_positions,
    decide_hit,
    decided_length,
    decode_replica_positions,
    decode_store_position,
    exact_replay,
    hit_cap,
    is_handed,
    lookup_hit,
    message_snapshot_indices,
    prefill_store_positions,
    resumes_exactly,
    shared_prefix_positions,
    snapshot_candidates,
    tail_parts,
    takes_tail,
    with_tail,
)
from kvledger.core.keys import (FORMAT_VERSION, KEY_BYTES, PUBLIC_NAMESPACE, chain_keys, chain_parent, continue_chain,
                                extend_chain, public_root, root_key, salted_namespace,
                                tail_key, tenant_of, token_bytes)
from kvledger.core.plan import CapacityPlan, Link, Traffic, break_even_tokens, plan
from kvledger.core.spec import DEFAULT_MODEL, LayerKind, ModelSpec

__all__ = [
    "CapacityPlan", "DEFAULT_MODEL", "FORMAT_VERSION", "HitDecision", "HitKind", "HitLookup", "KEY_BYTES",
    "MESSAGE_SNAPSHOTS", "LayerKind", "Link", "ModelSpec", "PUBLIC_NAMESPACE", "PromptDiff", "SnapshotLookup",
    "Traffic", "block_reach", "blocks_spanned", "break_even_tokens", "cap_blocks", "chain_keys", "chain_parent",
    "check_decision", "checkpoint_positions", "continue_chain", "decide_hit", "decided_length",
    "decode_replica_positions", "decode_store_position", "diff_prompts", "exact_replay", "extend_chain", "hit_cap",
    "is_handed", "lookup_hit", "message_snapshot_indices", "plan", "prefill_store_positions", "public_root",
    "resumes_exactly", "shared_prefix_positions", "root_key", "salted_namespace", "snapshot_candidates", "tail_key",
    "tail_parts", "takes_tail", "tenant_of", "token_bytes", "with_tail",
]
