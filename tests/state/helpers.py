"""Deterministic snapshots for tests: the same (seed, i) gives the same key and bytes in every process."""

from __future__ import annotations

import hashlib

import numpy as np


def snap_key(seed: int, i: int) -> bytes:
    return hashlib.sha256(f"kvledger-test/{seed}/{i}".encode()).digest()[:16]


def snap_bytes(seed: int, i: int, size: int) -> bytes:
    return np.random.default_rng([seed, i]).integers(0, 256, size, dtype=np.uint8).tobytes()


def digest(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
