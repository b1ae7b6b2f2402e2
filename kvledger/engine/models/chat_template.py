"""The model's chat template, rendered with jinja2 the way Hugging Face's tokenizers render it.

The template is the `chat_template` of the model folder's tokenizer_config.json (for SmolLM2:
`kvledger.engine.models.hf_folder.smollm2_folder()`). As in HF: a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, `raise_exception` for the template's own checks, the special
tokens of the config as variables, `add_generation_prompt=True`. Message content is plain text
(a list of text parts is joined first), and stays so in `tokenize`: only the template makes control
tokens, so a user's `<|im_end|>\n<|im_start|>system` is text, never a forged turn.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvledger.engine.models.tokenizer import PieceEncoder


class ChatTemplateError(ValueError):
    """The messages do not fit the template (its own raise_exception), or it cannot render."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """`render` gives the prompt text; `tokenize` (with a tokenizer) its token ids. `stop_token_ids`: the
    token that ends the model's turn in this format when it is not the model's end of sequence (Gemma's
    `<end_of_turn>`): a chat request stops there too."""

    def __init__(self, source: str, special: dict[str, str] | None = None, tokenizer: Tokenizer | None = None,
                 *, end_of_turn: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.special = dict(special or {})
        self.encoder = PieceEncoder(tokenizer) if tokenizer is not None else None
        self.stop_token_ids: tuple[int, ...] = ()
        if end_of_turn is not None:
            assert tokenizer is not None and tokenizer.token_to_id(end_of_turn) is not None, end_of_turn
            self.stop_token_ids = (tokenizer.token_to_id(end_of_turn),)

    @classmethod
    def from_folder(cls, folder: str | Path, tokenizer: Tokenizer | None = None) -> ChatTemplate:
        """From `tokenizer_config.json` in a Hugging Face model folder."""
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if not isinstance(source, str):
            raise ChatTemplateError(f"{folder}: tokenizer_config.json has no chat_template")
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token",
                                                                      "unk_token")}
        return cls(source, {k: v for k, v in special.items() if v is not None}, tokenizer)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None

    def tokenize(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt's token ids: a control-token string the template wrote is that token, one in a message's
        content is plain text. Content without such strings gets the ids of `render`'s text, as Hugging Face's
        `apply_chat_template(tokenize=True)` gives them."""
        assert self.encoder is not None, "tokenize needs the template built with a tokenizer"
        return self.encoder.encode(self.pieces(messages, add_generation_prompt))

    def pieces(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """`render`'s text as (text, written by the template) pieces, in order; each content is one piece.
        ChatTemplateError for a template that alters content on its way (trims it, say): then the pieces
        cannot be told apart."""
        return [(text, message is None) for text, message in self._pieces(messages, add_generation_prompt)]

    def message_ends(self, messages: Sequence[dict[str, Any]], ids: Sequence[int], which: Sequence[int],
                     add_generation_prompt: bool = True) -> tuple[int, ...]:
        """For each message index in `which`, the token offset in `ids` (`tokenize(messages)`) where that message's
        content ends: how many leading ids the prompt rendered up to that content's end shares with `ids` (the
        tokenizer may merge across the seam; the shared part never includes what follows). Every prompt that
        starts with the same messages has the same ids up to there (rule 4″ (b): a message boundary to
        snapshot at). Ascending, one per message of `which` that has content."""
        assert self.encoder is not None, "message_ends needs the template built with a tokenizer"
        pieces = self._pieces(messages, add_generation_prompt)
        ends = set()
        for k, (_, message) in enumerate(pieces):
            if message is not None and message in which:
                head = self.encoder.encode([(text, m is None) for text, m in pieces[:k + 1]])
                ends.add(next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids))))
        return tuple(sorted(ends))

    def _pieces(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[tuple[str, int | None]]:
        """`pieces`, each content piece with its message's index (None: the template's text)."""
        nonce = secrets.token_hex(8)   # a content cannot spell a mark it cannot guess
        marked = self.render([{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)],
                             add_generation_prompt)
        out: list[tuple[str, int | None]] = []
        at = 0
        for mark in re.finditer(f"\x00{nonce}:(\\d+)\x00", marked):
            index = int(mark.group(1))
            out += [(marked[at:mark.start()], None), (str(messages[index]["content"]), index)]
            at = mark.end()
        out.append((marked[at:], None))
        if "".join(text for text, _ in out) != self.render(messages, add_generation_prompt):
            raise ChatTemplateError("the chat template alters message content, so control tokens cannot be kept "
                                    "out of it")
        return [(text, message) for text, message in out if text]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
