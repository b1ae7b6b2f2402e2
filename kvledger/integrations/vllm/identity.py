"""Which model's KV a vLLM engine computes: the digest of its weights' content and the settings that change KV.

Rule 11: a key names the weights by their content, never by a name or a path, so that new weights written at
the same path (a redeploy) never read the old weights' KV. vLLM's `model_config.model` is a local folder, a
local GGUF file, or a Hugging Face hub name, which vLLM downloaded into the hub cache before it built the
connector (the engine loads the model first, then sizes its KV cache, then builds the connector). The hub name is
resolved as vLLM resolves it (`huggingface_hub.snapshot_download`, offline: the files are there); anything else
is refused at start, never keyed by its name.

The digest is `model_files.folder_digest` (config.json and every weight file, each hashed once per file stamp and
cached: 0.7-1.5 s per GB on the first start, docs/vllm.md), the one hasher `kvledger serve` uses too.

vLLM objects are duck-typed (`model_config.model`, `.revision`, `.dtype`, `.quantization`;
`load_config.load_format`, `.download_dir`): no vLLM import, the main test suite reads this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvledger.engine.models.model_files import ModelError, file_digest, folder_digest

# vLLM load formats whose weights are the files of the model's folder (or GGUF file) as they are. Any other
# ("dummy": random weights; "tensorizer", "runai_streamer": weights from elsewhere) is refused at start.
FOLDER_FORMATS = frozenset({"auto", "safetensors", "pt", "npcache", "gguf", "fastsafetensors", "sharded_state",
                            "bitsandbytes", "mistral"})


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What the KV's bytes depend on besides the KV geometry (which `KvGeometry` names).

    `weights`: SHA-256 (hex) of the weights' content (`folder_digest`, or `file_digest` of a GGUF file);
    `dtype`: the dtype vLLM computes in ("float32"); `quantization`: vLLM's quantization method (None: the
    checkpoint's own); `salt`: the connector's optional `model` setting, an extra name that only ever splits
    keys (two deployments that must not share), never the identity."""

    weights: str
    dtype: str
    quantization: str | None = None
    salt: str = ""

    def __post_init__(self) -> None:
        assert len(self.weights) == 64 and all(c in "0123456789abcdef" for c in self.weights), \
            "weights: a SHA-256 digest in hex"

    def digest(self) -> str:
        """SHA-256 (hex) of every field: what stands for the model in the connector spec's fingerprint."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvledger/vllm-model\0" + canon).hexdigest()


def model_path(model_config: Any, load_config: Any) -> Path:
    """The local folder (or GGUF file) vLLM loaded the weights from; ModelError when there is none."""
    fmt = str(getattr(load_config, "load_format", "auto")).lower()
    if fmt not in FOLDER_FORMATS:
        raise ModelError(f"kvledger connector: load format {fmt!r} does not load the model folder's files, so the "
                         "keys cannot name the weights' content (rule 11); use a format that does "
                         f"({', '.join(sorted(FOLDER_FORMATS))})")
    name = str(model_config.model)
    path = Path(name).expanduser()
    if path.is_dir() or path.is_file():
        return path
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(name, revision=getattr(model_config, "revision", None),
                                  cache_dir=getattr(load_config, "download_dir", None), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure is the same refusal: no local files to hash
        raise ModelError(f"kvledger connector: model {name!r} is neither a local folder nor in the Hugging Face "
                         f"cache ({type(e).__name__}: {e}); the keys need the weights' content (rule 11)") from None
    return Path(found)


def weights_digest(path: Path) -> str:
    """The digest of the weights at `path`: a folder's config.json and weight files, or one GGUF file."""
    if path.is_file():
        return file_digest(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"kvledger connector: {path} has no config.json")
    return folder_digest(path)


def model_identity(model_config: Any, load_config: Any, salt: str | None) -> ModelIdentity:
    """The identity of the model vLLM runs (hashing its weights the first time a file is seen; module docstring)."""
    dtype = str(model_config.dtype).removeprefix("torch.")
    quantization = getattr(model_config, "quantization", None)
    return ModelIdentity(weights_digest(model_path(model_config, load_config)), dtype,
                         str(quantization) if quantization else None, salt or "")
