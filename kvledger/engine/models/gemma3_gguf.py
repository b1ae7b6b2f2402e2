"""A Gemma 3 GGUF's config.json and weights under Hugging Face names (`hf_folder` writes the folder).

    GGUF (blk.{i}.)        Hugging Face (model.layers.{i}.)      note
    attn_norm              input_layernorm                       every *_norm: w_hf = w_gguf − 1
    attn_q / attn_k / attn_v / attn_output   self_attn.{q,k,v,o}_proj   no row permutation (NeoX RoPE)
    attn_q_norm / attn_k_norm                self_attn.{q,k}_norm       per head, 256 dims
    post_attention_norm    post_attention_layernorm
    ffn_norm               pre_feedforward_layernorm
    ffn_gate / ffn_up / ffn_down             mlp.{gate,up,down}_proj
    post_ffw_norm          post_feedforward_layernorm
    token_embd, output_norm                  model.embed_tokens, model.norm   (lm_head tied: no output.weight)

llama.cpp stores Gemma's RMSNorm scale as 1 + w; Hugging Face's `Gemma3RMSNorm` multiplies by (1 + w), so the
folder holds w = w_gguf − 1, as transformers' own GGUF loader does. Weights are dequantized with the `gguf`
package and kept in float32: the exact dequantized values (a bf16 copy would move the logits by more than
the 1e-3 the tests hold the engine to against transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.engine.models.gemma3 import LOCAL_ROPE_THETA
from kvledger.engine.models.model_files import hf_tensor_name

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
SLIDING_PATTERN = 6   # every 6th layer is full attention (layers 5, 11, 17 of 18), as transformers' default


def gemma3_config(field: Callable[[str], Any], vocab_size: int) -> dict[str, Any]:
    """config.json (transformers 5's Gemma3TextConfig) of a Gemma 3 GGUF from its metadata (`field(key)` → value)."""
    if field("general.architecture") != "gemma3":
        raise ValueError("not a Gemma 3 GGUF")
    if field("gemma3.attention.key_length") != field("gemma3.attention.value_length"):
        raise ValueError("a Gemma 3 with K and V of different widths")
    layers = int(field("gemma3.block_count"))
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": int(field("gemma3.embedding_length")),
        "intermediate_size": int(field("gemma3.feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": int(field("gemma3.attention.head_count")),
        "num_key_value_heads": int(field("gemma3.attention.head_count_kv")),
        "head_dim": int(field("gemma3.attention.key_length")), "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(field("gemma3.context_length")),
        "rms_norm_eps": float(field("gemma3.attention.layer_norm_rms_epsilon")),
        "sliding_window": int(field("gemma3.attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": float(field("gemma3.rope.freq_base"))},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA},
        },
        "query_pre_attn_scalar": int(field("gemma3.attention.key_length")),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "vocab_size": vocab_size, "tie_word_embeddings": True,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id")),
        "attention_bias": False, "torch_dtype": "float32",
    }


def gemma3_state_dict(reader: Any) -> dict[str, Any]:
    """The dequantized tensors of a `gguf.GGUFReader` under Hugging Face names, float32 torch tensors."""
    import torch
    from gguf.quants import dequantize

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        name = _hf_name(t.name)
        if name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        tensors[name] = torch.from_numpy(w)
    return tensors


def write_gemma3_weights(reader: Any, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(gemma3_state_dict(reader), str(path), metadata={"format": "pt"})


def _hf_name(gguf_name: str) -> str:
    return hf_tensor_name(gguf_name, _GLOBAL_NAMES, _LAYER_NAMES, "Gemma 3 GGUF tensor")
