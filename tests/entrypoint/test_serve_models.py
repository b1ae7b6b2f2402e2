"""`kvledger serve --model PATH`: a user's own GGUF file or Hugging Face folder, served like a registered model.

Three servers, one after the other on one data directory, answer the same greedy completion:
`--model smollm2-135m`, `--model <its GGUF file>` (the same weights file: the same model, so it hits the
blocks the first stored) and `--model <a Hugging Face folder>` (SmolLM2 converted: other weights files,
so other chain keys and no hit, and the same tokens)."""

import json

from kvledger.engine.models.registry import resolve
from kvledger.util.serve_process import ServeProcess

PROMPT = list(range(1000, 1300))   # 300 tokens: a hit reuses 2 blocks (the cap: ⌊299/128⌋·128 = 256)


def _serve(data_dir, model) -> tuple[str, list[int], int]:
    """(the served name, the greedy tokens, the cached tokens) of one completion on a fresh server."""
    server = ServeProcess(data_dir, model=str(model)).start()
    try:
        status, models = server.get("/v1/models")
        assert status == 200
        name = json.loads(models)["data"][0]["id"]
        status, out = server.post("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200, out
        assert out["model"] == name
        return name, out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        server.stop()


def test_a_gguf_file_and_a_folder_serve_the_named_models_tokens(tmp_path):
    smollm2 = resolve("smollm2-135m").weights
    data = tmp_path / "data"
    name, tokens, cached = _serve(data, "smollm2-135m")
    assert (name, cached, len(tokens)) == ("smollm2-135m", 0, 8)
    by_file = _serve(data, smollm2.locate())
    assert by_file == ("SmolLM2-135M-Instruct.Q4_1", tokens, 256)   # same weights file: its blocks hit
    folder = smollm2.folder()
    assert _serve(data, folder) == (folder.name, tokens, 0)          # other weights files: other keys


def test_a_cluster_serves_a_model_given_by_path(tmp_path):
    """`kvledger up --model PATH`: the entrypoint (no weights) and its engine resolve the path alike, so the engine
    registers under the name the entrypoint serves, and a request is routed to it."""
    import shutil

    from kvledger.entrypoint.cluster_process import ClusterProcess

    mine = shutil.copy(resolve("smollm2-135m").weights.locate(), tmp_path / "my-smol.gguf")
    with ClusterProcess(tmp_path / "data", prefill=0, decode=0, both=1, model=str(mine)) as cluster:
        status, out = _post(cluster.url, {"model": "my-smol", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert status == 200 and out["model"] == "my-smol" and len(out["choices"][0]["token_ids"]) >= 1, out


def _post(url: str, body: dict) -> tuple[int, dict]:
    from kvledger.util.serve_process import request

    status, raw = request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)
