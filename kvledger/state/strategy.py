"""Where snapshots are kept, chosen per deployment from one string.

  memory       (default) host memory only, single copy, found through the directory
  full         every snapshot also persisted to the snapshot files
  periodic:N   also checkpoint every N tokens during prefill (rule 4′: `core.checkpoint_positions`), and
               persist the snapshots at positions that are multiples of N tokens
  zero         keep none: every hit takes the bounded-replay path (`replay` is True)

The first three are the V4 paper's disk policies plus DeepInfer's in-memory one. Periodic is the V4
chapter's middle strategy: a prompt that shares only a prefix of an earlier one (a long document, then
another question) resumes exactly at most N tokens before where their blocks part, for about L / N more
snapshots per prompt (Gemma 3: 7.6 MiB each).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class StrategyKind(StrEnum):
    MEMORY = "memory"
    FULL = "full"
    PERIODIC = "periodic"
    ZERO = "zero"


@dataclass(frozen=True, slots=True)
class Strategy:
    """Invariant: `every` > 0 iff kind is PERIODIC."""

    kind: StrategyKind = StrategyKind.MEMORY
    every: int = 0  # tokens between persisted snapshots (periodic only)

    def __post_init__(self) -> None:
        assert (self.every > 0) == (self.kind is StrategyKind.PERIODIC)

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """"memory" | "full" | "zero" | "periodic:N" (N > 0 tokens); ValueError otherwise."""
        name, sep, arg = text.strip().partition(":")
        try:
            kind = StrategyKind(name)
        except ValueError:
            raise ValueError(f"unknown state strategy {text!r}; expected memory, full, periodic:N or zero") from None
        if kind is StrategyKind.PERIODIC:
            if not arg.isdigit() or int(arg) <= 0:
                raise ValueError(f"periodic needs a positive token count, as in periodic:4096; got {text!r}")
            return cls(kind, int(arg))
        if sep:
            raise ValueError(f"strategy {name!r} takes no argument; got {text!r}")
        return cls(kind)

    @property
    def keeps(self) -> bool:
        """Snapshots go into host memory and the directory."""
        return self.kind is not StrategyKind.ZERO

    @property
    def replay(self) -> bool:
        """Hits never find a snapshot, so they should take bounded replay (decide_hit(replay=True))."""
        return self.kind is StrategyKind.ZERO

    @property
    def persists_any(self) -> bool:
        return self.kind in (StrategyKind.FULL, StrategyKind.PERIODIC)

    @property
    def checkpoint_every(self) -> int:
        """Tokens between the snapshots a prefill takes besides rule 4's (0: none; `core.checkpoint_positions`)."""
        return self.every

    def persists(self, position: int) -> bool:
        """Whether the snapshot at `position` (tokens) is also written to the snapshot files."""
        if self.kind is StrategyKind.FULL:
            return True
        return self.kind is StrategyKind.PERIODIC and position > 0 and position % self.every == 0

    def check(self, block_size: int) -> None:
        """ValueError unless snapshot positions (multiples of `block_size`) can land on every N."""
        if self.kind is StrategyKind.PERIODIC and self.every % block_size:
            raise ValueError(f"periodic:{self.every}: N must be a multiple of the block size {block_size}")

    def __str__(self) -> str:
        return f"periodic:{self.every}" if self.kind is StrategyKind.PERIODIC else self.kind.value
