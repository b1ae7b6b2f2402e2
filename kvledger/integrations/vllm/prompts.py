"""Long prompts for the vLLM tests and bench: natural text (`data/document.txt`, package data), tokenized
with a model's tokenizer, cut to an exact length. `variant` changes the first line, so each variant shares
no block with another (a cold prompt for each round of a bench).

`data/document.txt` is this repository's README.md as of commit 7e26b3b, frozen: the prompts (and so the
tests' and the recorded runs' token ids) no longer change when the README does, and an installed package
has them without a checkout."""

from __future__ import annotations

from pathlib import Path

from kvledger.engine.models.registry import DEFAULT_MODEL, load_tokenizer

DOCUMENT = Path(__file__).with_name("data") / "document.txt"


def long_prompt(n_tokens: int, variant: int = 0, *, model: str = DEFAULT_MODEL, bos: int | None = None) -> list[int]:
    """`n_tokens` token ids: `bos` if given (Gemma needs its <bos>, 2), "Session {variant}." then the
    document, repeated as needed, in `model`'s tokenizer."""
    assert n_tokens > 0
    tokenizer = load_tokenizer(model)
    body = DOCUMENT.read_text(encoding="utf-8")
    special = {} if bos is None else {"add_special_tokens": False}   # `bos` once, first, not per piece
    ids = [] if bos is None else [bos]
    ids += tokenizer.encode(f"Session {variant}. Read the document, then summarize it.\n\n", **special).ids
    while len(ids) < n_tokens:
        ids += tokenizer.encode(body, **special).ids
    return ids[:n_tokens]
