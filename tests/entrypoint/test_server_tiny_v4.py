"""`kvledger serve --model tiny-v4`: token-id prompts, both ledgers, the hit cap of a sliding-window model."""

from kvledger.util.serve_process import ServeProcess

SWA_RESERVE = 134   # W + K: the last 134 prompt tokens are always computed (DESIGN.md rule 3)


def test_tiny_v4_serves_token_ids_and_hits_its_cap(tmp_path):
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        body = {"model": "tiny-v4", "prompt": list(range(1, 600)), "max_tokens": 4, "temperature": 0}
        status, first = server.post("/v1/completions", body)
        assert status == 200, first
        status, second = server.post("/v1/completions", body)
        assert status == 200, second
        cap = (599 - SWA_RESERVE) // 128 * 128
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cap == 384
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        status, err = server.post("/v1/chat/completions", {"model": "tiny-v4",
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "token ids" in err["error"]["message"]
        status, err = server.post("/v1/completions", {"model": "tiny-v4", "prompt": "some text"})
        assert status == 400 and err["error"]["param"] == "prompt"
    finally:
        server.stop()
