"""The model identity the vLLM connector keys by (rule 11): the weights' content, cached per file stamp.

No vLLM here: vLLM's configs are duck-typed records. A cached digest is recognised by planting a sentinel in the
cache entry of a file's stamp: a lookup that returns the sentinel did not hash the file, one that returns the
file's real SHA-256 did.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvledger.core import root_key
from kvledger.engine.models.model_files import FileStamp, ModelError, file_digest, folder_digest
from kvledger.integrations.vllm.config import KvGeometry, connector_spec
from kvledger.integrations.vllm.identity import ModelIdentity, model_identity, model_path

SENTINEL = "5e" * 32
GEOMETRY = KvGeometry(n_layers=2, kv_heads=2, head_dim=8, dtype_bytes=4, device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvledger" / "digests"


def plant(path: Path, digest: str = SENTINEL) -> None:
    """Put `digest` in the cache entry of `path`'s current stamp, as `file_digest` writes entries (0600)."""
    stamp = FileStamp.of(path)
    entry = stamp.entry()
    entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry.write_text(json.dumps({"stamp": {f: getattr(stamp, f) for f in stamp.__slots__}, "sha256": digest}))
    entry.chmod(0o600)


def model_folder(root: Path, weights: bytes = b"w" * 4096, config: str = '{"hidden_size": 16}') -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text("{}")   # not weights: never hashed
    return root


def test_an_untouched_file_is_not_hashed_again_and_its_cache_is_private(tmp_path, cache):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 1000)
    assert file_digest(f) == hashlib.sha256(b"x" * 1000).hexdigest()
    (entry,) = cache.glob("*.json")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600 and stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert json.loads(entry.read_text())["stamp"]["size"] == 1000
    plant(f)
    assert file_digest(f) == SENTINEL   # the same stamp: read from the cache, not hashed


@pytest.mark.parametrize("change", ["mtime", "size", "inode"])
def test_a_changed_stamp_is_hashed_again(tmp_path, change):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 1000)
    st = f.stat()
    plant(f)
    if change == "mtime":
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        expected = b"x" * 1000
    elif change == "size":
        f.write_bytes(b"x" * 1001)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        expected = b"x" * 1001
    else:   # a redeploy that writes a new file and renames it over the old one, size and mtime kept
        other = tmp_path / "w.new"
        other.write_bytes(b"y" * 1000)
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(other, f)
        assert f.stat().st_ino != st.st_ino
        expected = b"y" * 1000
    assert file_digest(f) == hashlib.sha256(expected).hexdigest()


def test_an_entry_others_can_write_is_not_trusted(tmp_path, cache):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 1000)
    plant(f)
    FileStamp.of(f).entry().chmod(0o666)
    assert file_digest(f) == hashlib.sha256(b"x" * 1000).hexdigest()
    cache.chmod(0o777)   # a cache folder left open is made private again before it is written
    f.write_bytes(b"z" * 10)
    file_digest(f)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_a_folder_digest_covers_config_and_every_weight_file_by_content(tmp_path):
    a = model_folder(tmp_path / "a")
    digest = folder_digest(a)
    files = {"config.json": file_digest(a / "config.json"), "model.safetensors": file_digest(a / "model.safetensors")}
    assert digest == hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()  # `kvledger serve`'s
    assert folder_digest(shutil.copytree(a, tmp_path / "b")) == digest   # content, not the path
    (a / "tokenizer.json").write_text('{"other": 1}')
    assert folder_digest(a) == digest
    (a / "config.json").write_text('{"hidden_size": 32}')
    assert folder_digest(a) != digest
    c = model_folder(tmp_path / "c")
    (c / "extra.bin").write_bytes(b"more weights")
    assert folder_digest(c) != digest
    (c / "model.safetensors").unlink()
    (c / "extra.bin").unlink()
    with pytest.raises(ModelError, match="no weight files"):
        folder_digest(c)


def vllm_configs(model: str, *, load_format: str = "auto", dtype: str = "torch.float32") -> tuple:
    """vLLM's `model_config` and `load_config`, duck-typed (the fields the connector reads)."""
    return (SimpleNamespace(model=model, revision=None, dtype=dtype, quantization=None),
            SimpleNamespace(load_format=load_format, download_dir=None))


def test_new_weights_at_the_same_path_are_another_model(tmp_path):
    folder = model_folder(tmp_path / "m")
    old = model_identity(*vllm_configs(str(folder)), salt="served-name")
    assert old.weights == folder_digest(folder) and old.dtype == "float32" and old.salt == "served-name"
    (folder / "model.safetensors").write_bytes(b"v" * 4096)   # a redeploy: same path, same size, same config
    new = model_identity(*vllm_configs(str(folder)), salt="served-name")
    assert new.weights != old.weights
    roots = {root_key(connector_spec(i, GEOMETRY), "default") for i in (old, new)}
    assert len(roots) == 2


def test_the_salt_and_the_compute_settings_split_keys_and_the_path_does_not(tmp_path):
    a = model_folder(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "b")
    base = model_identity(*vllm_configs(str(a)), salt=None)
    assert model_identity(*vllm_configs(str(b)), salt=None) == base
    variants = [base, ModelIdentity(base.weights, "float32", salt="tenant-fleet"),
                ModelIdentity(base.weights, "bfloat16"), ModelIdentity(base.weights, "float32", quantization="fp8")]
    assert len({connector_spec(i, GEOMETRY).fingerprint() for i in variants}) == len(variants)
    bf16_kv = KvGeometry(2, 2, 8, 2, "cpu", "bfloat16")
    f16_kv = KvGeometry(2, 2, 8, 2, "cpu", "float16")   # same bytes per token: only the dtype's name differs
    assert connector_spec(base, bf16_kv).fingerprint() != connector_spec(base, f16_kv).fingerprint()


def test_a_model_without_local_weights_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelError, match="neither a local folder nor in the Hugging Face cache"):
        model_path(*vllm_configs("nobody/no-such-model"))
    folder = model_folder(tmp_path / "m")
    with pytest.raises(ModelError, match="load format 'dummy'"):
        model_path(*vllm_configs(str(folder), load_format="dummy"))
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match="no config.json"):
        model_identity(*vllm_configs(str(folder)), salt=None)


def test_a_gguf_file_is_its_own_digest(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    identity = model_identity(*vllm_configs(str(f), load_format="gguf"), salt=None)
    assert identity.weights == hashlib.sha256(f.read_bytes()).hexdigest()


def test_a_hub_name_is_the_folder_vllm_downloaded_into_the_hugging_face_cache(tmp_path, monkeypatch):
    """vLLM downloads a hub model before it builds the connector; the name resolves to that snapshot, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    snapshot = model_folder(repo / "snapshots" / ("c0" * 20))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0" * 20)
    model_config, load_config = vllm_configs("org/tiny")
    load_config.download_dir = str(hub)
    assert model_path(model_config, load_config) == snapshot
    assert model_identity(model_config, load_config, salt=None).weights == folder_digest(snapshot)
