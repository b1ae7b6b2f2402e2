"""CHECK before routing (rule 5): the hit of a prompt from metadata alone, no KV byte read.

    keys, decision = check_prompt(tokens, spec, block_ledger=blocks, state_ledger=states)

The block ledger's index answers how many leading blocks exist; `core.lookup_hit` asks the state
ledger's directory, in one batched lookup, which of the positions that can matter hold a snapshot (L1
alone for a model that falls back; every boundary up to L1 for one that resumes exactly, rule 3′) and
turns both into the decision the engine follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvledger.core import HitDecision, HitLookup, ModelSpec, continue_chain, lookup_hit
from kvledger.state.ledger import StateLedger
from kvledger.store.backend import Match
from kvledger.store.ledger import BlockLedger


def check_prompt(tokens: Any, spec: ModelSpec, *, block_ledger: BlockLedger, state_ledger: StateLedger | None,
                 namespace: str = "default", ttl_class: str | None = None, replay: bool = False,
                 known_keys: Sequence[bytes] = (), prompt_len: int | None = None,
                 public_blocks: int = 0) -> tuple[list[bytes], HitDecision]:
    """`check_prompt_explained`'s keys and decision."""
    keys, lookup, _ = check_prompt_explained(tokens, spec, block_ledger=block_ledger, state_ledger=state_ledger,
                                             namespace=namespace, ttl_class=ttl_class, replay=replay,
                                             known_keys=known_keys, prompt_len=prompt_len,
                                             public_blocks=public_blocks)
    return keys, lookup.decision


def check_prompt_explained(tokens: Any, spec: ModelSpec, *, block_ledger: BlockLedger,
                           state_ledger: StateLedger | None, namespace: str = "default", ttl_class: str | None = None,
                           replay: bool = False, known_keys: Sequence[bytes] = (), prompt_len: int | None = None,
                           public_blocks: int = 0) -> tuple[list[bytes], HitLookup, Match]:
    """Chain keys + CHECK on the index + `core.lookup_hit` over the directory (the decision, and L1, which says
    where the blocks alone reach), and the index's answer (`store.backend.Match`: the leading blocks present, the
    first absent one's tombstone, if it kept one).

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
    snapshots = None if state_ledger is None else lambda at: state_ledger.positions(keys, at=at)
    hit = lookup_hit(len(arr), found.blocks, snapshots, spec, replay=replay,
                     request_prompt_len=prompt_len or None)
    return keys, hit, found
