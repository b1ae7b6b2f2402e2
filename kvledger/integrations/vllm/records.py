"""The typed records the scheduler side hands the worker side each step.

vLLM carries its connector metadata from the scheduler to the workers itself (it pickles
it between its own processes: vLLM's boundary, not a kvledger file or socket). kvledger
never pickles: its own store files hold packed structs.

No vLLM import here: the main test suite reads this module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Consecutive blocks of one request's chain, moved between vLLM's KV cache and the ledger.

    Block j of the run is chain position `start + j`: its key is `keys[j]` and its KV lives
    in vLLM block `block_ids[j]`. `parent` is the key before `keys[0]` (None at position 0).
    Invariants: len(keys) == len(block_ids) > 0; parent is None iff start == 0.
    """

    req_id: str
    namespace: str
    start: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes | None

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.block_ids) > 0, "one vLLM block per key"
        assert (self.parent is None) == (self.start == 0), "a parent exactly when the run starts past 0"

    @property
    def end(self) -> int:
        """Chain position after the run's last block."""
        return self.start + len(self.keys)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduler step's transfers: `loads` fill vLLM blocks from the ledger before the
    forward pass (layer by layer); `saves` copy newly completed full blocks out after it."""

    loads: tuple[BlockRun, ...] = ()
    saves: tuple[BlockRun, ...] = ()
