"""A small random-weight Llama as a Hugging Face folder, whose KV heads split over 2 and 4 workers.

8 attention heads, 4 KV heads of 64 dimensions, hidden 512, 4 layers, float32, seeded weights, SmolLM2's
tokenizer files and vocabulary (49,152 tokens), so the vLLM tests' prompts are valid token ids. The weights are
drawn at a scale that makes the logits peaked (a random Llama at the usual 0.02 answers near-ties everywhere,
and a greedy token could flip on float rounding alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 4, 512, 8, 4, 64, 1024, 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write the model into `folder` (created); returns it."""
    import torch
    from safetensors.torch import save_file

    from kvledger.engine.models.registry import resolve

    folder.mkdir(parents=True)
    smollm2 = resolve("smollm2-135m").weights.folder()
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, folder / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": VOCAB,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
              "mlp_bias": False, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": w(VOCAB, HIDDEN, scale=0.2)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(HIDDEN),
                    p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                    p + "self_attn.q_proj.weight": w(q, HIDDEN, scale=HIDDEN ** -0.5),
                    p + "self_attn.k_proj.weight": w(kv, HIDDEN, scale=HIDDEN ** -0.5),
                    p + "self_attn.v_proj.weight": w(kv, HIDDEN, scale=HIDDEN ** -0.5),
                    p + "self_attn.o_proj.weight": w(HIDDEN, q, scale=q ** -0.5),
                    p + "mlp.gate_proj.weight": w(FFN, HIDDEN, scale=HIDDEN ** -0.5),
                    p + "mlp.up_proj.weight": w(FFN, HIDDEN, scale=HIDDEN ** -0.5),
                    p + "mlp.down_proj.weight": w(HIDDEN, FFN, scale=FFN ** -0.5)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
