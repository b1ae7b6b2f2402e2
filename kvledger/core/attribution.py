"""Why a prompt missed: its miss tokens split by cause (pure; the entrypoint's CHECK supplies the facts).

A prompt of L tokens whose CHECK found its leading blocks up to L1 = min(blocks present · B, cap) and decided
`d` (cap, hit = d.hit_tokens; rule 3′ lowers d.block_hit_tokens below L1 to where it resumes exactly) and
whose engine then reused `cached` tokens (rule 8 may lower it) misses L − cached tokens. They split, left to
right:

    | tokens                | cause                                                                  |
    |-----------------------|------------------------------------------------------------------------|
    | [cached, hit)         | load_failed: promised by the CHECK, unreadable when fetched             |
    | [hit, L1)             | snapshot_missing: blocks present, the window not (fallback, replay)     |
    | [L1, cap)             | the first absent block's cause (`BLOCK_CAUSES`): expired, evicted,      |
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


def split_misses(prompt_len: int, decision: HitDecision, block_tokens: int, cached: int, block_cause: MissCause,
                 divergence: int | None = None, diverged_block: int | None = None) -> MissSplit:
    """The miss tokens of one prompt by cause (the module's table). `block_cause` is the first absent block's
    (one of BLOCK_CAUSES; unused when every block up to the cap hit); `divergence` goes with DIVERGED;
    `block_tokens` is L1. A divergence in a later block than L1's (`diverged_block`: that block's first token;
    blocks of a prompt seen a moment ago, not in the index yet) leaves [L1, diverged_block) cold: known content,
    not stored yet.
    `cached` may exceed the decision's hit (an engine found more in its own device cache than the CHECK saw):
    each range then starts at `cached` at the earliest."""
    assert block_cause in BLOCK_CAUSES
    d, cap, l1 = decision, max(decision.cap, 0), block_tokens
    assert 0 <= d.hit_tokens <= l1 <= cap <= prompt_len and 0 <= cached <= prompt_len, (prompt_len, d, l1, cached)
    split_at = l1   # where block_cause starts: a divergence's block
    if block_cause is MissCause.DIVERGED and diverged_block is not None:
        split_at = min(max(diverged_block, l1), cap)
    ranges = ((MissCause.LOAD_FAILED, 0, d.hit_tokens), (MissCause.SNAPSHOT_MISSING, d.hit_tokens, l1),
              (MissCause.COLD, l1, split_at), (block_cause, split_at, cap), (MissCause.TAIL, cap, prompt_len))
    tokens: dict[MissCause, int] = {}
    for cause, start, end in ranges:
        if (n := end - max(start, cached)) > 0:
            tokens[cause] = tokens.get(cause, 0) + n
    split = MissSplit(tokens, divergence if MissCause.DIVERGED in tokens else None)
    assert split.total == prompt_len - cached
    return split
