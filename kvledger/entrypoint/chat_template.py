"""The model's chat template, rendered with jinja2 the way Hugging Face's tokenizers render it.

The template is the `chat_template` of the model folder's tokenizer_config.json (for SmolLM2:
`kvledger.engine.models.hf_folder.smollm2_folder()`). As in HF: a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, `raise_exception` for the template's own checks, the special
tokens of the config as variables, `add_generation_prompt=True`. Message content is plain text
(a list of text parts is joined first).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages do not fit the template (its own raise_exception), or it cannot render."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.special = dict(special or {})

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate:
        """From `tokenizer_config.json` in a Hugging Face model folder."""
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if not isinstance(source, str):
            raise ChatTemplateError(f"{folder}: tokenizer_config.json has no chat_template")
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token",
                                                                      "unk_token")}
        return cls(source, {k: v for k, v in special.items() if v is not None})

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
