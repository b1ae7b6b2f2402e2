"""Shared helpers of the tiny-v4 tests: one model, prompts, and a cold prefill that keeps its ledger bytes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvledger.engine.models.tiny_v4 import TinyV4
from tests.engine.models.tiny_v4_paths import ledger_blocks, run
from kvledger.engine.models.tiny_v4_state import SeqState, snapshot_bytes


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))


@dataclass(slots=True)
class Cold:
    """A cold prefill, run block by block, with what the ledgers would hold afterwards."""

    state: SeqState
    logits: torch.Tensor          # every row from the YoCo anchor on
    blocks: list[bytes]           # block ledger: every closed block
    snapshots: dict[int, bytes]   # state ledger: the window at every block boundary


def cold_with_ledgers(model: TinyV4, tokens: torch.Tensor) -> Cold:
    state = model.new_state(len(tokens))
    size, outs, snapshots = model.spec.block_size, [], {}
    for lo in range(0, len(tokens), size):
        out = run(model, state, tokens[lo:lo + size], all_logits=True)
        if out is not None:
            outs.append(out)
        if state.pos % size == 0:
            snapshots[state.pos] = snapshot_bytes(state, model.spec, state.pos)
    return Cold(state, torch.cat(outs), ledger_blocks(model, state, len(tokens) // size), snapshots)


@pytest.fixture(scope="module")
def tiny_v4() -> TinyV4:
    """One tiny-v4 (fixed seed) per module; torch on one thread meanwhile (on a loaded 2-core machine
    two competing threads run these small GEMMs several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TinyV4()
    torch.set_num_threads(threads)
