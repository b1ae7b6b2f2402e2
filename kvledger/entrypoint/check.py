"""CHECK before routing (rule 5): the hit of a prompt from metadata alone, no KV byte read.

    keys, decision = check_prompt(tokens, spec, block_ledger=blocks, state_ledger=states)

The block ledger's index answers how many leading blocks exist; for a model with sliding-window
layers the state ledger's directory answers which of `core.snapshot_candidates` hold a snapshot
(L1 alone for a model that falls back; every boundary up to L1 for one that resumes exactly,
rule 3′), in one batched lookup; `core.decide_hit` turns both into the decision the engine follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvledger.core import HitDecision, ModelSpec, continue_chain, decide_hit, decided_length, snapshot_candidates
from kvledger.state.ledger import StateLedger
from kvledger.store.backend import Match
from kvledger.store.ledger import BlockLedger


def check_prompt(tokens: Any, spec: ModelSpec, *, block_ledger: BlockLedger, state_ledger: StateLedger | None,
                 namespace: str = "default", ttl_class: str | None = None, replay: bool = False,
                 known_keys: Sequence[bytes] = (), prompt_len: int | None = None,
                 public_blocks: int = 0) -> tuple[list[bytes], HitDecision]:
    """`check_prompt_explained` without the tombstone."""
    keys, decision, _ = check_prompt_explained(tokens, spec, block_ledger=block_ledger, state_ledger=state_ledger,
                                               namespace=namespace, ttl_class=ttl_class, replay=replay,
                                               known_keys=known_keys, prompt_len=prompt_len,
                                               public_blocks=public_blocks)
    return keys, decision


def check_prompt_explained(tokens: Any, spec: ModelSpec, *, block_ledger: BlockLedger,
                           state_ledger: StateLedger | None, namespace: str = "default", ttl_class: str | None = None,
                           replay: bool = False, known_keys: Sequence[bytes] = (), prompt_len: int | None = None,
                           public_blocks: int = 0) -> tuple[list[bytes], HitDecision, Match]:
    """Chain keys + CHECK on the index + the directory's snapshot positions + decide_hit, and the index's answer
    (`store.backend.Match`: the leading blocks present, the first absent one's tombstone, if it kept one).

    `known_keys`: the keys of the leading blocks of `tokens`, computed earlier in this process (a later leg
    of the same request): only the blocks after them are hashed. `prompt_len`: the request's own prompt length when
    `tokens` continue it (a later leg: the prompt + the output so far); the decision is made on
    `core.decided_length` (rule 10). `public_blocks`: the leading whole blocks that are a published public prefix,
    keyed under the public root (`core.chain_parent`). Faults read as misses (the ledgers never
    raise on them): a CHECK that cannot reach its index answers 0 blocks, a directory that cannot be
    reached answers no snapshot."""
    arr = np.asarray(tokens, dtype=np.uint32)
    b = spec.block_size
    assert len(known_keys) <= len(arr) // b, "known keys name full blocks of this prompt"
    keys = continue_chain(arr, spec, namespace, known_keys, public_blocks=public_blocks)
    found = block_ledger.match_explained(keys, namespace=namespace, ttl_class=ttl_class)
    cached = found.blocks
    snapshots: set[int] = set()
    length = decided_length(len(arr), prompt_len or len(arr), spec)
    at = snapshot_candidates(length, cached, spec, replay=replay)
    if at and state_ledger is not None:
        snapshots = state_ledger.positions(keys, at=at)
    return keys, decide_hit(length, cached, snapshots, spec, replay=replay), found
