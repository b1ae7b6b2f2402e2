"""What kvledger reads of a model's files without loading the model: a file's digest, a GGUF's metadata, and the
Hugging Face name of a GGUF tensor. The model sources (`weights`), the GGUF converters (`hf_folder`, `gemma3_gguf`)
and the registry all read them here.

Hashing a file costs ~1 s per GB, so a file's digest is cached under $XDG_CACHE_HOME/kvledger/digests, keyed by
(path, inode, size, mtime, ctime): a restart does not rehash, a rewritten or replaced file is hashed again.

`gguf_fields(path)` reads a GGUF's scalar metadata (`general.architecture`, `llama.block_count` ...) without the
tensors or the arrays (the vocabulary): milliseconds, where `gguf.GGUFReader` takes seconds. `ModelError` is
raised for anything that is not a model kvledger can read.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """Not a model kvledger can serve: a missing path, an unknown name, an unsupported architecture. The
    message is one line, meant for the user as is."""


def cache_dir() -> Path:
    """kvledger's cache folder: $XDG_CACHE_HOME/kvledger (~/.cache/kvledger)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvledger"


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of the file at `path`, cached by (resolved path, inode, size, mtime_ns, ctime_ns). The
    ctime is there because a copy can keep the size and set the mtime (`cp -p`, `rsync -t`), but no tool sets
    the ctime: another file under the same name is hashed again, never given the old file's digest (which
    would let two models share blocks)."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    tag = hashlib.sha256(stamp.encode()).hexdigest()[:32]
    cached = cache_dir() / "digests" / tag
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


def hf_tensor_name(gguf_name: str, global_names: dict[str, str], layer_names: dict[str, str],
                   what: str = "GGUF tensor") -> str:
    """The Hugging Face name of a GGUF tensor: a global one by `global_names`, `blk.<i>.<part>.<suffix>` as
    `model.layers.<i>.<layer_names[part]>.<suffix>`; ValueError naming `what` for any other."""
    if gguf_name in global_names:
        return global_names[gguf_name]
    blk, layer, part, suffix = gguf_name.split(".")
    if blk != "blk" or part not in layer_names:
        raise ValueError(f"unexpected {what} {gguf_name!r}")
    return f"model.layers.{int(layer)}.{layer_names[part]}.{suffix}"
