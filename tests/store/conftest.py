"""Fixtures of the block-ledger tests: chains of blocks whose bytes are a function of their key,
and a clock the tests move by hand (TTL and GC without sleeping)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvledger.core import ModelSpec, chain_keys, root_key

SPEC = ModelSpec.preset("tiny-v4")
BLOCK = 4096  # small blocks keep the suite fast; the store does not care about the size


def block_of(key: bytes, size: int = BLOCK) -> bytes:
    """The bytes every test stores under `key` (so a reader can check what it got)."""
    return hashlib.shake_128(key).digest(size)


def chain(n: int, namespace: str = "default", seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * SPEC.block_size, dtype=np.uint32)
    keys = chain_keys(tokens, SPEC, namespace)
    return keys, [block_of(k) for k in keys]


def root(namespace: str = "default") -> bytes:
    return root_key(SPEC, namespace)


class FakeClock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
