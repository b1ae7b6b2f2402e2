"""Why a prompt missed: its miss tokens split by cause (pure; the entrypoint's CHECK supplies the facts).

A prompt of L tokens whose CHECK decided `d` (cap, L1 = d.block_hit_tokens, hit = d.hit_tokens) and whose
engine then reused `cached` tokens (rule 8 may lower it) misses L − cached tokens. They split, left to right:

    | tokens                | cause                                                                  |
    |-----------------------|------------------------------------------------------------------------|
    | [cached, hit)         | load_failed: promised by the CHECK, unreadable when fetched             |
    | [hit, L1)             | snapshot_missing: blocks present, the window not (fallback, replay)     |
    | [L1, cap)             | the first absent block's cause (`BlockCause`): expired, evicted,        |
    |                       | diverged or cold                                                       |
    | [max(cap, 0), L)      | tail: the last R tokens and the partial block, which no cache serves   |

The first absent block decides [L1, cap): blocks expire tails first, and a chain is matched from its head,
so nothing after it can hit whatever it holds. Its cause, in order of precedence:

- expired / evicted: the index keeps a tombstone of the block (it was stored, and removed by its TTL or
  for room);
- diverged: a cached prompt of this namespace went on past L1 and this one differs from it at token t
  (a timestamp, a request id, a re-serialized schema): its prefix up to t was known, and lost;
- cold: nothing cached of this namespace continued there (a prompt never seen, or one that extends what
  was cached, as a conversation's next turn does).

Invariant: the causes' tokens sum to L − cached, each >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvledger.core.hit import HitDecision


class MissCause(StrEnum):
    COLD = "cold"
    DIVERGED = "diverged"
    EXPIRED = "expired"
    EVICTED = "evicted"
    LOAD_FAILED = "load_failed"
    SNAPSHOT_MISSING = "snapshot_missing"
    TAIL = "tail"


BLOCK_CAUSES = (MissCause.COLD, MissCause.DIVERGED, MissCause.EXPIRED, MissCause.EVICTED)


@dataclass(frozen=True, slots=True)
class MissSplit:
    """Miss tokens by cause (only causes with tokens), and where the prompt diverged (diverged only)."""

    tokens: dict[MissCause, int]
    divergence: int | None = None     # token index of the first difference from the nearest cached prompt

    @property
    def total(self) -> int:
        return sum(self.tokens.values())


def split_misses(prompt_len: int, decision: HitDecision, cached: int, block_cause: MissCause,
                 divergence: int | None = None) -> MissSplit:
    """The miss tokens of one prompt by cause (the module's table). `block_cause` is the first absent block's
    (one of BLOCK_CAUSES; unused when every block up to the cap hit); `divergence` goes with DIVERGED."""
    assert block_cause in BLOCK_CAUSES
    d, cap = decision, max(decision.cap, 0)
    assert 0 <= cached <= d.hit_tokens <= d.block_hit_tokens <= cap <= prompt_len, (prompt_len, d, cached)
    parts = {MissCause.LOAD_FAILED: d.hit_tokens - cached,
             MissCause.SNAPSHOT_MISSING: d.block_hit_tokens - d.hit_tokens,
             block_cause: cap - d.block_hit_tokens,
             MissCause.TAIL: prompt_len - cap}
    tokens = {cause: n for cause, n in parts.items() if n > 0}
    split = MissSplit(tokens, divergence if MissCause.DIVERGED in tokens else None)
    assert split.total == prompt_len - cached
    return split
