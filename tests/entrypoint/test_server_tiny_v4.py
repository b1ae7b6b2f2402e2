"""`kvledger serve --model tiny-v4`: token-id prompts, both ledgers, the hit cap of a sliding-window model."""

import json
import threading
import time
import urllib.request

import numpy as np

from kvledger.core import ModelSpec, chain_keys
from kvledger.store.ledger import BlockLedger, blocks_dir
from kvledger.util.serve_process import ServeProcess
from tests.engine.helpers import flip_byte_of_block
from tests.entrypoint.metrics_text import metric
from tests.entrypoint.page_dom import page_misses

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
        assert server.post("/v1/completions", body | {"prompt": list(range(1, 101))})[0] == 200
        status, raw = server.get("/dashboard/activity")
        ttft = json.loads(raw)["ttft_by_length"]
        assert status == 200 and [(b["tokens_from"], b["tokens_to"]) for b in ttft["buckets"]] == [(65, 128),
                                                                                                    (513, 1024)]
        short, long = ttft["buckets"]
        assert (short["cold"]["requests"], short["hit"]["requests"]) == (1, 0) and short["hit"]["p50_s"] is None
        assert (long["cold"]["requests"], long["hit"]["requests"]) == (1, 1)
        assert min(long["hit"]["p50_s"], long["cold"]["p50_s"], short["cold"]["p50_s"]) > 0
        status, err = server.post("/v1/chat/completions", {"model": "tiny-v4",
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "token ids" in err["error"]["message"]
        status, err = server.post("/v1/completions", {"model": "tiny-v4", "prompt": "some text"})
        assert status == 400 and err["error"]["param"] == "prompt"
    finally:
        server.stop()


def _metrics(server) -> str:
    status, raw = server.get("/metrics")
    assert status == 200
    return raw.decode()


def test_fetch_bytes_count_only_store_reads_and_a_corrupt_block_reaches_metrics(tmp_path):
    """kvledger_fetch_bytes_total counts what the fetcher read, never an estimate from cached tokens (a
    device-cache hit reads nothing); a block damaged on disk is found by the fetcher process, and its
    cause reaches kvledger_store_read_misses_total{cause="corrupt"} of the server. (SmolLM2: its blocks
    alone decide a hit, so after a restart, with no snapshot anywhere, the hit still reads the store.)"""
    tokens = list(range(1, 600))
    body = {"model": "smollm2-135m", "prompt": tokens, "max_tokens": 2, "temperature": 0}
    spec = ModelSpec.preset("smollm2-135m")
    server = ServeProcess(tmp_path / "data").start()
    try:
        assert server.post("/v1/completions", body)[0] == 200
        status, hit = server.post("/v1/completions", body)
        assert status == 200 and hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        assert hit["usage"]["kvledger"]["store_cached_tokens"] == 0   # all of it from the device cache
        text = _metrics(server)
        assert metric(text, "kvledger_fetch_bytes_total") == 0
        assert metric(text, "kvledger_store_read_misses_total", cause="corrupt") == 0
    finally:
        server.stop()
    keys = chain_keys(np.asarray(tokens, dtype=np.uint32), spec, "default")
    flip_byte_of_block(blocks_dir(tmp_path / "data"), keys[1])
    server = ServeProcess(tmp_path / "data").start()   # a fresh device cache: reads go to the store
    try:
        status, out = server.post("/v1/completions", body)
        assert status == 200, out   # rule 8: a corrupt block is a miss, never a failed request
        text = _metrics(server)
        assert metric(text, "kvledger_store_read_misses_total", cause="corrupt") == 1
        assert metric(text, "kvledger_cache_miss_blocks_total", cause="load_failed") >= 1
        # the hit of 512 tokens fetches blocks 0-3 in one job; block 1 fails its checksum: the bytes of the
        # three that arrived intact are counted, and the hit is lowered to the leading one
        assert metric(text, "kvledger_fetch_bytes_total") == 3 * spec.block_bytes()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    finally:
        server.stop()


def _stream(url: str, body: dict, started: threading.Event, out: list) -> None:
    """The SSE chunks of one streamed completion into `out`; `started` set at the first one."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                out.append(json.loads(line.removeprefix("data: ")))
                started.set()
    started.set()


def test_a_poisoned_sampling_request_never_stops_another_stream(tmp_path):
    """top_p=1e-300 (0 in float32) at temperature > 0 made torch.multinomial raise, and the engine failed every
    running request: another tenant's stream stopped half-way with engine_error. Now the poisoned request is
    served (its top-1 token kept) and repetition_penalty=1e-40 is a 400; the stream gets all its tokens."""
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        normal = {"model": "tiny-v4", "prompt": list(range(1, 60)), "max_tokens": 120, "temperature": 0.8,
                  "seed": 1, "ignore_eos": True, "stream": True}
        started, chunks = threading.Event(), []
        reader = threading.Thread(target=_stream, args=(server.url, normal, started, chunks))
        reader.start()
        assert started.wait(120)
        poison = {"model": "tiny-v4", "prompt": list(range(7, 30)), "max_tokens": 4, "temperature": 1.0}
        tiny_top_p = server.post("/v1/completions", poison | {"top_p": 1e-300})
        tiny_penalty = server.post("/v1/completions", poison | {"repetition_penalty": 1e-40})
        reader.join(300)
        tokens = [t for c in chunks if "choices" in c for t in c["choices"][0]["token_ids"]]
        assert not any("error" in c for c in chunks), (len(tokens), [c for c in chunks if "error" in c])
        assert len(tokens) == 120 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        status, body = tiny_top_p
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 4, body
        status, body = tiny_penalty
        assert status == 400 and body["error"]["param"] == "repetition_penalty", body
    finally:
        server.stop()


def test_blocks_without_their_window_are_snapshot_missing(tmp_path):
    """Prompt P (1000 tokens) leaves snapshots at 768 and 896. Q shares P's first 700 tokens: its blocks hit to
    640, where no snapshot lies (nor below): rule 3′ resumes exactly from 0, so [0, 640) is snapshot_missing,
    the block [640, 768) diverged at 700, and the last 232 tokens are the tail."""
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        p = np.random.default_rng(3).integers(100, 30000, 1000).tolist()
        q = p[:700] + np.random.default_rng(4).integers(100, 30000, 300).tolist()
        body = {"model": "tiny-v4", "max_tokens": 1, "temperature": 0, "explain_cache_miss": True}
        status, first = server.post("/v1/completions", body | {"prompt": p})
        assert status == 200 and first["usage"]["kvledger"]["miss"]["causes"] == {"cold": 768, "tail": 232}
        keys = chain_keys(np.asarray(p, dtype=np.uint32), ModelSpec.preset("tiny-v4"))
        with BlockLedger.open(path=blocks_dir(tmp_path / "data")) as ledger:   # P's blocks are written behind
            deadline = time.monotonic() + 30                                     # its reply: wait for them
            while ledger.match(keys) < 7:
                assert time.monotonic() < deadline, "P's blocks never reached the store"
                time.sleep(0.05)
        status, second = server.post("/v1/completions", body | {"prompt": q})
        assert status == 200, second
        miss = second["usage"]["kvledger"]["miss"]
        assert miss["causes"] == {"snapshot_missing": 640, "diverged": 128, "tail": 232}
        assert miss["divergence"]["position"] == 700
        text = _metrics(server)
        assert metric(text, "kvledger_prompt_miss_tokens_total", cause="snapshot_missing") == 640
        assert metric(text, "kvledger_engine_preemptions_total") == 0   # exported; its big pool never runs out
        table, bars = page_misses(server.url, tmp_path / "profile")
        assert table["default"]["snapshot_missing"] == 640 and ("snapshot_missing", 640) in bars
    finally:
        server.stop()
