"""The hit rule (rule 3) and the snapshot store positions (rule 4).

Positions are token indices into the prompt; B = block size, W = window, K = backtrack.
The block ledger decides how far a prefix can be reused (L1); the state ledger decides
whether the last reused block is exact (a snapshot at L1), recomputed (fallback), or
replayed for the sliding-window layers only (bounded replay).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from kvledger.core.spec import ModelSpec


class HitKind(StrEnum):
    MISS = "miss"          # nothing reusable (prompt too short, or no leading block cached)
    SNAPSHOT = "snapshot"  # blocks up to L1 and the snapshot at L1: exact resume at L1
    FALLBACK = "fallback"  # no snapshot: the block [L1 - B, L1) is recomputed by every layer
    REPLAY = "replay"      # no snapshot: the block [L1 - B, L1) is replayed by sliding-window layers only
    FULL = "full"          # a model without sliding-window layers: blocks alone decide


@dataclass(frozen=True, slots=True)
class HitDecision:
    """What a request reuses and where computation starts.

    Invariants: 0 <= hit_tokens <= block_hit_tokens <= cap; all three are multiples of B;
    recompute_from <= hit_tokens; block KV in [0, hit_tokens) is reused, never recomputed;
    truncate_from is None or equals recompute_from (> 0).
    """

    kind: HitKind
    hit_tokens: int            # prompt tokens reported as cached
    block_hit_tokens: int      # L1: prompt tokens whose block KV is reused or recomputed-over
    swa_hit: bool              # the snapshot at L1 was used
    recompute_from: int        # first prompt position any layer computes
    truncate_from: int | None  # s: sliding windows start no earlier than this (None: not truncated)
    cap: int                   # the most any hit could be for this prompt length

    @property
    def replay(self) -> bool:
        """Sliding-window layers compute [recompute_from, block_hit_tokens) while block KV there is reused."""
        return self.kind is HitKind.REPLAY


def _check_count(name: str, n: object) -> None:
    """`ValueError` unless `n` is an int >= 0 (a bool, a float or a numpy float is refused: 1.5 blocks is a bug)."""
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):  # int and numpy ints, not bool or floats
        raise ValueError(f"{name} must be an integer, got {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


def hit_cap(prompt_len: int, spec: ModelSpec) -> int:
    """⌊(L − R) / B⌋ · B, floored at 0: the last R prompt tokens are always computed."""
    _check_count("prompt_len", prompt_len)
    b = spec.block_size
    return max((prompt_len - spec.reserve_tokens) // b * b, 0)


def decide_hit(
    prompt_len: int,
    cached_blocks: int,
    swa_snapshots: Collection[int],
    spec: ModelSpec,
    *,
    replay: bool = False,
) -> HitDecision:
    """Rule 3. `cached_blocks`: leading blocks the block ledger holds (may exceed the cap);
    `swa_snapshots`: positions that hold a snapshot for this prefix (only L1 matters)."""
    _check_count("cached_blocks", cached_blocks)
    b = spec.block_size
    cap = hit_cap(prompt_len, spec)
    l1 = min(cached_blocks * b, cap)
    if l1 == 0:
        return HitDecision(HitKind.MISS, 0, 0, False, 0, None, cap)
    if not spec.has_swa:
        return HitDecision(HitKind.FULL, l1, l1, False, l1, None, cap)
    if l1 in swa_snapshots:
        return HitDecision(HitKind.SNAPSHOT, l1, l1, True, l1, None, cap)
    s = l1 - b
    truncate = s if s > 0 else None  # a window starting at 0 is not truncated
    if replay:
        return HitDecision(HitKind.REPLAY, l1, l1, False, s, truncate, cap)
    return HitDecision(HitKind.FALLBACK, s, l1, False, s, truncate, cap)


def prefill_store_positions(prompt_len: int, spec: ModelSpec) -> tuple[int, ...]:
    """Rule 4: the positions at which prefill stores a snapshot, ascending.

    c = ⌊(L − R)/B⌋·B, the prompt's own hit cap: an identical retry, a regeneration or an
      edit of the last R tokens has L1 = c and resumes exactly;
    p = ⌊(L − 1)/B⌋·B, the last boundary before the last token: a next turn that extends the
      prompt has L1 = p and resumes exactly.
    Each is skipped when 0. With R > B (V4: 134 > 128) c ≤ p − B, so they never coincide; a
    model with R ≤ B may have c = p, stored once. Empty for models without sliding-window
    layers. Only the last chunk of a chunked prefill stores. Both windows lie in the prefill
    kvstore ring (396 for V4): c ≥ L − R − B + 1.

    Worked example (V4, L = 1000): c = ⌊866/128⌋·128 = 768, p = ⌊999/128⌋·128 = 896 → (768, 896).
    """
    if prompt_len < 0:
        raise ValueError("prompt_len must be >= 0")
    if not spec.has_swa:
        return ()
    b = spec.block_size
    c = hit_cap(prompt_len, spec)
    p = (prompt_len - 1) // b * b if prompt_len > 0 else 0
    return tuple(sorted({x for x in (c, p) if x > 0}))


def decode_replica_positions(prompt_len: int, kv_len: int, spec: ModelSpec) -> range:
    """Rule 4: the multiples of B the sequence crosses while decoding from `prompt_len` to
    `kv_len` tokens of KV; at each, the window is copied into the replica area."""
    if not 0 <= prompt_len <= kv_len:
        raise ValueError("need 0 <= prompt_len <= kv_len")
    if not spec.has_swa:
        return range(0)
    b = spec.block_size
    first = prompt_len // b * b + b
    return range(first, kv_len // b * b + 1, b)


def decode_store_position(prompt_len: int, kv_len: int, spec: ModelSpec) -> int | None:
    """Rule 4: at request end the latest completed replica copy is stored, attached at its boundary."""
    crossed = decode_replica_positions(prompt_len, kv_len, spec)
    return crossed[-1] if crossed else None
