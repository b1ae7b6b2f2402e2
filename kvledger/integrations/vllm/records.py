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

    Block j of the run is chain position `start + j`: its chain key is `keys[j]` and its KV lives
    in vLLM block `block_ids[j]`. `parent` is the key before `keys[0]` (None at position 0).
    A load's `sources[j]` is the partition block j is read from (an index into `Slicing.partitions()`,
    the one the scheduler's CHECK found whole); empty: every block from the engine's own (index 0).
    Invariants: len(keys) == len(block_ids) > 0; parent is None iff start == 0; sources empty or one per key.
    """

    req_id: str
    namespace: str
    start: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes | None
    sources: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.block_ids) > 0, "one vLLM block per key"
        assert (self.parent is None) == (self.start == 0), "a parent exactly when the run starts past 0"
        assert not self.sources or len(self.sources) == len(self.keys), "one source per block"

    @property
    def end(self) -> int:
        """Chain position after the run's last block."""
        return self.start + len(self.keys)


@dataclass(frozen=True, slots=True)
class KvGroups:
    """Which of vLLM's KV cache groups is which (vLLM numbers them; the layers of one group share
    one block table). `full`: the group of the full-attention layers, whose vLLM block j is ledger
    block j; `windows`: the sliding-window groups, whose blocks hold the window a snapshot keeps.
    A full-attention model under vLLM is one group: KvGroups(0)."""

    full: int = 0
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.full not in self.windows and len(set(self.windows)) == len(self.windows)


@dataclass(frozen=True, slots=True)
class WindowRun:
    """The sliding-window KV of one request at block boundary `position` (a snapshot, rule 4′).

    Window block j holds tokens [start + j·B, start + (j + 1)·B), start = position − len·B,
    len = min(W, position) / B; `block_ids[g][j]` is the vLLM block of window group g
    (`KvGroups.windows` order) holding it. `key` is the chain key of the block ending at
    `position`. `skip` leading window blocks are not written on a load (vLLM's own prefix cache
    holds them). Invariants: position > 0 and a multiple of B; every group has len blocks; skip < len.
    """

    req_id: str
    key: bytes
    position: int
    block_ids: tuple[tuple[int, ...], ...]
    skip: int = 0

    def __post_init__(self) -> None:
        assert self.position > 0 and self.block_ids, "a window at a boundary past 0, in some group"
        n = len(self.block_ids[0])
        assert n > 0 and all(len(ids) == n for ids in self.block_ids), "one block per window block and group"
        assert 0 <= self.skip < n


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduler step's transfers: `loads` fill vLLM blocks from the ledger before the
    forward pass (layer by layer); `saves` copy newly completed full blocks out after it;
    `window_loads` and `window_saves` do the same for sliding-window snapshots (state ledger).

    `by_request`: the loads are vLLM's asynchronous loads (a hybrid model: vLLM takes failures
    per request, not per block id, when there are several KV cache groups); the requests are
    not in this step's forward, and the worker reports each as finished, or failed (then vLLM
    recomputes it from 0: exact)."""

    loads: tuple[BlockRun, ...] = ()
    saves: tuple[BlockRun, ...] = ()
    window_loads: tuple[WindowRun, ...] = ()
    window_saves: tuple[WindowRun, ...] = ()
    by_request: bool = False
