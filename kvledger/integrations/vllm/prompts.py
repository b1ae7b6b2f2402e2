"""Long prompts for the vLLM tests and bench: natural text (this repository's README), tokenized
with SmolLM2's tokenizer, cut to an exact length. `variant` changes the first line, so each
variant shares no block with another (a cold prompt for each round of a bench)."""

from __future__ import annotations

from pathlib import Path

from kvledger.engine.models.registry import DEFAULT_MODEL, load_tokenizer

README = Path(__file__).resolve().parents[3] / "README.md"


def long_prompt(n_tokens: int, variant: int = 0) -> list[int]:
    """`n_tokens` token ids: "Session {variant}." then the README, repeated as needed."""
    assert n_tokens > 0
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    body = README.read_text(encoding="utf-8")
    ids = tokenizer.encode(f"Session {variant}. Read the document, then summarize it.\n\n").ids
    while len(ids) < n_tokens:
        ids += tokenizer.encode(body).ids
    return ids[:n_tokens]
