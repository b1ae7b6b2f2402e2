"""Prompt diff: after prompt A was served and cached, how much of prompt B hits, and why not more.

Prefix caching only reuses an exact token prefix, so one changed token near the front
(a timestamp, a request id, a re-serialized tool schema) makes every later block miss.
The diff finds that token, the span that differs, and what moving it would win back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.core.hit import HitDecision, decide_hit, prefill_store_positions
from kvledger.core.keys import chain_keys
from kvledger.core.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class PromptDiff:
    """Positions are token indices. `a_span`/`b_span` are the half-open ranges that differ
    once the longest common prefix and suffix are removed (both empty when identical)."""

    len_a: int
    len_b: int
    first_divergence: int | None  # first index where the token lists differ; None when identical
    a_span: tuple[int, int]
    b_span: tuple[int, int]
    cached_blocks_a: int          # full blocks A leaves on the block ledger
    hit_blocks: int               # leading blocks of B whose chain keys A stored
    blocks_b: int                 # full blocks of B
    decision: HitDecision         # rule 3 for B, with A's prefill snapshot if it lies on the shared prefix
    recoverable_blocks: int       # more blocks of B that would hit with the differing span moved to the end
    reasons: tuple[str, ...]      # why B's blocks after `hit_blocks` miss, first cause first


def diff_prompts(a: Sequence[int], b: Sequence[int], spec: ModelSpec, namespace: str = "default",
                 namespace_b: str | None = None) -> PromptDiff:
    """A was cached in `namespace`; B is asked in `namespace_b` (the same by default). Hits are
    decided by chain keys alone, so two namespaces share no block whatever their tokens."""
    keys_a = chain_keys(a, spec, namespace)
    keys_b = chain_keys(b, spec, namespace if namespace_b is None else namespace_b)
    same_ns = namespace_b is None or namespace_b == namespace
    hit_blocks = 0
    for ka, kb in zip(keys_a, keys_b):
        if ka != kb:
            break
        hit_blocks += 1

    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n if len(a) != len(b) else None)
    bs = spec.block_size
    if first is None:
        a_span = b_span = (len(a), len(a))
    else:
        suffix = 0
        while suffix < min(len(a), len(b)) - first and a[-1 - suffix] == b[-1 - suffix]:
            suffix += 1
        a_span, b_span = (first, len(a) - suffix), (first, len(b) - suffix)
    expected = min(n // bs if first is None else first // bs, len(keys_a), len(keys_b)) if same_ns else 0
    assert hit_blocks == expected, "chain keys disagree with the token diff"

    snapshots = {p for p in prefill_store_positions(len(a), spec) if p <= hit_blocks * bs}
    decision = decide_hit(len(b), hit_blocks, snapshots, spec)

    # With the differing spans moved to the end, A and B would share their common prefix
    # and common suffix as one prefix: the blocks of that, beyond today's hits, are won back.
    common = min(len(a) - (a_span[1] - a_span[0]), len(b) - (b_span[1] - b_span[0]))
    recoverable = max(common // bs - hit_blocks, 0) if same_ns else 0

    return PromptDiff(
        len_a=len(a), len_b=len(b), first_divergence=first, a_span=a_span, b_span=b_span,
        cached_blocks_a=len(keys_a), hit_blocks=hit_blocks, blocks_b=len(keys_b), decision=decision,
        recoverable_blocks=recoverable,
        reasons=(() if same_ns else ("A and B are in different namespaces: they share no block",))
        + _reasons(first, hit_blocks, len(keys_a), len(keys_b), decision, spec, same_ns),
    )


def _reasons(
    first: int | None, hit: int, blocks_a: int, blocks_b: int, d: HitDecision, spec: ModelSpec, same_ns: bool
) -> tuple[str, ...]:
    bs = spec.block_size
    out: list[str] = []
    if not same_ns:
        return ()
    if first is not None and first // bs < min(blocks_a, blocks_b):
        blk = first // bs
        out.append(f"token {first} differs, so block {blk} [{blk * bs}, {(blk + 1) * bs}) "
                   f"and every later block miss: a chain key covers the whole prefix")
    elif blocks_b > blocks_a:
        out.append(f"B's blocks {blocks_a}..{blocks_b - 1} lie past A's last full block: never cached")
    if d.block_hit_tokens < hit * bs:
        out.append(f"the last {spec.reserve_tokens} prompt tokens are always computed: "
                   f"at most {d.cap} tokens of B can hit")
    if d.hit_tokens < d.block_hit_tokens:
        out.append(f"no sliding-window snapshot at {d.block_hit_tokens}: "
                   f"block [{d.recompute_from}, {d.block_hit_tokens}) is recomputed")
    if not out and first is None:
        out.append("prompts are identical")
    return tuple(out)
