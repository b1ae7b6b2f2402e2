"""Published public prefixes (DESIGN rule 12): a system prompt, a tool list or a document that every tenant shares.

An operator publishes a prefix (`--public-prefix FILE` at start, `POST /admin/public-prefixes` at run time). A
request whose prompt starts with the whole blocks of a published prefix reads and writes those blocks (and, for a
windowed model, the window at their end) under the public root (`core.public_root`), so N tenants compute it
once; its chain continues under the tenant's own namespace from the first block past them (`core.chain_parent`),
so a private continuation is never reachable from another tenant.

    prefixes = PublicPrefixes.of([tokens_a, tokens_b], block_size=128)
    prefixes.blocks(prompt)          # leading whole blocks of `prompt` that are a published prefix's (0: none)

Only whole blocks are public: a prefix of 1,000 tokens publishes its first 896 (B = 128), and a prefix shorter
than one block publishes nothing (refused when published). A prompt matches a prefix when it starts with all of
the prefix's whole blocks; of several, the longest wins. Tenants cannot publish (the endpoint needs an operator
key) and cannot write into the public chain by naming a namespace (no namespace has the public root).

The file: JSON, a list whose items are token-id lists, or strings tokenized as the start of a prompt (as
`/v1/completions` tokenizes a prompt string, with the model's BOS if it adds one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_PREFIXES = 1024   # published at once (each match is one comparison of its tokens)


class PublicPrefixError(ValueError):
    """`--public-prefix FILE` cannot be used (the message names the file and why)."""


@dataclass(frozen=True, slots=True)
class PublicPrefixes:
    """The published prefixes, each cut to whole blocks, longest first. Immutable: a change makes a new one,
    swapped in whole, so a request reads one consistent set without a lock.

    Invariant: every prefix is a non-empty multiple of `block_size` tokens, and no two are equal."""

    block_size: int
    prefixes: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        assert all(p.size and p.size % self.block_size == 0 for p in self.prefixes)
        assert len({p.tobytes() for p in self.prefixes}) == len(self.prefixes)

    @classmethod
    def of(cls, items: Sequence[Sequence[int] | np.ndarray], *, block_size: int) -> PublicPrefixes:
        return cls(block_size).with_added(items)

    def blocks(self, tokens: np.ndarray) -> int:
        """The leading whole blocks of `tokens` that are a published prefix's (the longest that matches; 0: none)."""
        for p in self.prefixes:   # longest first
            if tokens.size >= p.size and np.array_equal(tokens[:p.size], p):
                return p.size // self.block_size
        return 0

    def with_added(self, items: Sequence[Sequence[int] | np.ndarray]) -> PublicPrefixes:
        """These prefixes published too; `ValueError` for one shorter than a block or beyond MAX_PREFIXES."""
        have = {p.tobytes(): p for p in self.prefixes}
        for item in items:
            p = whole_blocks(item, self.block_size)
            have.setdefault(p.tobytes(), p)
        if len(have) > MAX_PREFIXES:
            raise ValueError(f"at most {MAX_PREFIXES} public prefixes are published at once")
        return PublicPrefixes(self.block_size, tuple(sorted(have.values(), key=lambda p: -p.size)))

    def without(self, items: Sequence[Sequence[int] | np.ndarray]) -> tuple[PublicPrefixes, int]:
        """These prefixes withdrawn (their blocks stay in the store until they expire); how many were published."""
        gone = {whole_blocks(item, self.block_size).tobytes() for item in items}
        kept = tuple(p for p in self.prefixes if p.tobytes() not in gone)
        return PublicPrefixes(self.block_size, kept), len(self.prefixes) - len(kept)

    def describe(self) -> list[dict[str, Any]]:
        """What the operator endpoint lists: each prefix's length and a digest of its tokens (not the tokens)."""
        return [{"tokens": int(p.size), "blocks": int(p.size // self.block_size),
                 "sha256": hashlib.sha256(p.astype("<u4").tobytes()).hexdigest()[:16]} for p in self.prefixes]


def whole_blocks(item: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """`item`'s whole blocks as uint32; `ValueError` when it has none or holds a value that is not a token id."""
    arr = np.asarray(item)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or (arr.size and int(arr.min()) < 0):
        raise ValueError("a public prefix is a list of token ids (non-negative integers) or a string")
    n = arr.size // block_size * block_size
    if n == 0:
        raise ValueError(f"a public prefix of {arr.size} tokens has no whole block of {block_size}: nothing to share")
    return np.ascontiguousarray(arr[:n], dtype=np.uint32)


def parse_items(raw: Any, tokenize: Callable[[str], list[int]] | None, vocab_size: int | None
                ) -> list[np.ndarray]:
    """The JSON list of an operator's prefixes as token arrays; `ValueError` naming what is wrong. `vocab_size`:
    token ids at or above it are refused (None: not known yet, as before a cluster's first engine registers; an id
    no prompt can hold then never matches)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("public prefixes are a non-empty JSON list of token-id lists or strings")
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if tokenize is None:
                raise ValueError(f"item {i}: a string needs a tokenizer, and there is none here; give token ids")
            item = tokenize(item)
        if not isinstance(item, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise ValueError(f"item {i}: a list of token ids or a string")
        bad = next((t for t in item if not 0 <= t < (vocab_size or 2**32)), None)
        if bad is not None:
            raise ValueError(f"item {i}: token ids must be in [0, {vocab_size or 2**32}); {bad} is not")
        out.append(np.asarray(item, dtype=np.uint32))
    return out


def load_public_prefixes(path: Path, tokenize: Callable[[str], list[int]] | None, vocab_size: int | None,
                         block_size: int) -> PublicPrefixes:
    """`--public-prefix FILE`; `PublicPrefixError` "--public-prefix FILE: ..." on a file that cannot be used."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        return PublicPrefixes.of(parse_items(raw, tokenize, vocab_size), block_size=block_size)
    except OSError as e:
        raise PublicPrefixError(f"--public-prefix {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise PublicPrefixError(f"--public-prefix {path}: {e}") from None
