"""What the reference scripts share (`gemma3_reference_logits.py`, `smollm2_reference_logits.py`): transformers'
own model on a GGUF's dequantized weights, and the few KB per prompt that the tests compare with kvledger's logits.

Run with .venv-vllm, which has transformers (.venv does not). The model comes from transformers' own GGUF loader
(`load_gguf_checkpoint`: its names, its un-permuting of llama.cpp's Q and K rows, its norm − 1 for Gemma), not the
packed-kernel load (`from_pretrained(..., gguf_file=...)`), which rounds differently (shared/notes/gemma3.md):
an implementation independent of kvledger's. Eager attention, float32 compute.

For each prompt a record keeps the ids, the last position's 64 largest logits (ids and values), the largest
|logit| over the whole vocabulary (the scale of the relative error), and the greedy continuation. No
whole-vocabulary vectors.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

SHORT = "The capital of France is"
# ~700 tokens of plain prose (written for these scripts): longer than Gemma 3's 512-token window, so its sliding
# layers really slide, and not a multiple of 128 for either model.
LONG = """\
The lighthouse at the end of the northern breakwater was built in the winter of a hard year, when the harbour \
had lost three boats in a single storm and the town council finally agreed that a lantern on a pole was not \
enough. The engineer they hired came from the capital with a leather case of drawings and a habit of measuring \
everything twice. He walked the breakwater at low tide, counted the stones, tapped them with a small hammer and \
wrote the sounds in a notebook. The fishermen laughed at him for a week, and then they stopped laughing, because \
he found the place where the sea had hollowed out the foundation and showed them how the next storm would have \
taken the whole end of the wall.

The tower itself went up in eleven months. The stone was cut in a quarry two valleys inland and carried down on \
carts pulled by oxen, then on a barge that the engineer had designed so that it could be beached and unloaded \
at any state of the tide. Each course of stone was dovetailed into the one below, so that the tower would behave \
like a single rock rather than a pile of blocks. The masons complained that the joints were too fine and the \
mortar too expensive, but the engineer paid them by the course and not by the day, and the work went quickly.

At the top he placed a lantern room of iron and glass, and inside it a lamp that burned colza oil and later \
paraffin. Around the lamp turned a great lens made of rings of glass prisms, each ring bending the light a \
little more than the one inside it, so that all of it left the tower as a single flat beam. A clockwork driven by \
a falling weight turned the lens once every twenty seconds, and the keeper had to wind the weight back up every \
four hours through the night. Ships far out at sea saw a white flash, then darkness, then another flash, and \
from the rhythm they knew which light it was and where they were.

The first keeper was a retired sailor who had lost two fingers to a rope. He lived in the tower with his wife and \
kept a log in which he wrote the weather, the state of the sea, the ships he saw and the hours at which he lit \
and put out the lamp. His wife kept a second log, which nobody asked her to keep, in which she wrote what the \
birds did before a storm, how the swallows flew low and the gulls came in from the open water and stood on the \
roofs of the town facing the wind. Years later, when the harbour master wanted to know whether the storms had \
grown worse, it was her log and not her husband's that gave him the answer.

The light was electrified after the war, and the clockwork was replaced by a motor. The last keeper left when the \
lamp was automated, and the tower stood empty for a long time, visited only by a technician who came once a \
month to change the bulbs and check the batteries. Then the town bought it back for a single coin and opened it \
to visitors. Today you can climb the one hundred and twelve steps to the lantern room, stand beside the great \
lens and look out over the harbour, the breakwater and the grey line of the open sea. On the wall beside the \
door hang the two logs, open at the same winter night, and in both of them, in two different hands, the same \
words are written: wind rising from the north, the boats all in, the light burning well. The guide who shows \
you around will tell you that the engineer never saw the finished tower, because"""
TOP = 64
GREEDY = 8


def load(gguf: Path, weight_dtype: torch.dtype = torch.float32):
    """transformers' model and tokenizer of `gguf`, float32, each weight rounded through `weight_dtype` first."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(v).to(weight_dtype).float() for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head must be tied"
    return model.float().eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


@torch.inference_mode()
def reference(model, tokenizer, name: str, text: str, bos: int | None = None) -> dict:
    """One prompt's record: `text`'s ids with no special tokens added, after `bos` where one is given."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if bos is not None:
        assert ids[0] != bos, "the tokenizer added <bos> itself"
        ids = [bos] + ids
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, TOP)
    out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY, do_sample=False, top_p=None, top_k=None)
    greedy = out[0, len(ids):].tolist()
    return {"name": name, "text": text, "ids": ids, "top_ids": top.indices.tolist(),
            "top_logits": [round(float(x), 6) for x in top.values], "max_abs_logit": float(logits.abs().max()),
            "greedy_ids": greedy, "greedy_text": tokenizer.decode(greedy)}


def write(out: Path, gguf: Path, made_by: str, started: float, loaded: float, prompts: list[dict]) -> None:
    """The file the test reads: the prompts' records and how they were made. `started`, `loaded`: perf_counter()s."""
    import transformers

    record = {
        "command": "python " + " ".join(sys.argv), "made_by": made_by,
        "transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "gguf": gguf.name, "gguf_sha256": _sha256(gguf), "load_s": round(loaded - started, 1), "top": TOP,
        "prompts": prompts,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    for q in prompts:
        print(f"{q['name']}: {len(q['ids'])} tokens, max |logit| {q['max_abs_logit']:.3f}, greedy {q['greedy_text']!r}")
    print(f"wrote {out} ({out.stat().st_size:,} B) in {time.perf_counter() - started:.0f} s")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
