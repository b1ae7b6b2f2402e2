"""What kvledger reads of a model's files without loading the model: a file's digest, a GGUF's metadata, and the
Hugging Face name of a GGUF tensor. The model sources (`weights`), the GGUF converters (`hf_folder`, `gemma3_gguf`)
and the registry all read them here.

Hashing a file costs 0.7-1.5 s per GB (SHA-256 on the 2-core Xeon, page cache or disk: docs/vllm.md), so its digest is
cached under $XDG_CACHE_HOME/kvledger/digests, keyed by (path, inode, size, mtime, ctime): a restart does not rehash, a
rewritten or replaced file is hashed again. `folder_digest` is a model folder's digest (its config and weight files).

`gguf_fields(path)` reads a GGUF's scalar metadata (`general.architecture`, `llama.block_count` ...) without the
tensors or the arrays (the vocabulary): milliseconds, where `gguf.GGUFReader` takes seconds. `ModelError` is
raised for anything that is not a model kvledger can read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """Not a model kvledger can serve: a missing path, an unknown name, an unsupported architecture. The
    message is one line, meant for the user as is."""


def cache_dir() -> Path:
    """kvledger's cache folder: $XDG_CACHE_HOME/kvledger (~/.cache/kvledger)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvledger"


def digest_dir() -> Path:
    """Where file digests are cached: one JSON file per (file, stamp), 0600, in folders 0700.

    Machine-local on purpose (not beside a block store, which may be a mount many machines share): a stamp's
    path and inode name a file on this machine only."""
    return cache_dir() / "digests"


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What says a file is the one hashed before: its resolved path, inode, size (bytes) and times (ns).

    The ctime is there because a copy can keep the size and set the mtime (`cp -p`, `rsync -t`), but no tool sets
    the ctime: another file under the same name is hashed again, never given the old file's digest (which would
    let two models share blocks)."""

    path: str
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()
        return cls(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def entry(self) -> Path:
        """The cache file of this stamp."""
        text = f"{self.path}|{self.inode}|{self.size}|{self.mtime_ns}|{self.ctime_ns}"
        return digest_dir() / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of the file at `path`, cached by its `FileStamp` (one JSON file per stamp, `digest_dir`).

    Processes that start together (vLLM's scheduler and its workers) hash a file once: the first takes the
    cache's lock, the others wait for it and read its result. A cache entry is used only if this user owns it,
    nobody else can write it, and it names the same stamp; an unwritable cache only costs the next start the hash."""
    stamp = FileStamp.of(path)
    entry = stamp.entry()
    cached = _read_entry(entry, stamp)
    if cached is not None:
        return cached
    with _entry_lock(entry):
        cached = _read_entry(entry, stamp)
        if cached is not None:
            return cached
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        _write_entry(entry, stamp, digest)
    return digest


def folder_digest(folder: Path) -> str:
    """SHA-256 (hex) of a model folder: config.json and every weight file (`WEIGHT_PATTERNS`, top level), each
    hashed by name with `file_digest`. A folder of config.json and *.safetensors has the digest it had before
    other weight formats were counted (`kvledger serve`'s keys of such a folder do not change)."""
    files = [folder / "config.json", *weight_files(folder)]
    parts = {f.name: file_digest(f) for f in files}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# The files a model folder's weights may be in (the formats vLLM and Transformers load), top level only.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files, sorted by name (a stable order); ModelError when there are none."""
    found = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if not found:
        raise ModelError(f"{folder}: no weight files ({', '.join(WEIGHT_PATTERNS)})")
    return found


def _read_entry(entry: Path, stamp: FileStamp) -> str | None:
    """The digest an entry holds for `stamp`; None when absent, foreign, writable by others or of another stamp."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        record = json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(record, dict) or record.get("stamp") != asdict(stamp):
        return None
    digest = record.get("sha256")
    if not isinstance(digest, str):
        return None
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None


def _private_dir(folder: Path) -> bool:
    """Create `folder` 0700 (a folder of this user's made so, as a cache of an older kvledger left it 0755);
    whether it is a folder only this user can write."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.lstat()
        if st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(folder, 0o700)
            st = folder.lstat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700


@contextlib.contextmanager
def _entry_lock(entry: Path) -> Iterator[None]:
    """An exclusive lock on the cache folder's one lock file while a file is hashed (none when the cache is
    unwritable): hashes run one at a time, each file once."""
    if not _private_dir(entry.parent):
        yield
        return
    try:
        fd = os.open(entry.parent / "lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_entry(entry: Path, stamp: FileStamp, digest: str) -> None:
    """Write the entry atomically, 0600 (a temporary file renamed over it)."""
    if not _private_dir(entry.parent):
        return
    tmp = entry.with_suffix(f".{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps({"stamp": asdict(stamp), "sha256": digest}).encode())
        finally:
            os.close(fd)
        os.replace(tmp, entry)
    except OSError:
        pass   # an unwritable cache only costs the next start the hash


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
