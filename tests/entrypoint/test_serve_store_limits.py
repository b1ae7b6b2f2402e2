"""`kvledger serve --ttl-classes / --store-capacity / --kv-cache-bytes`: the limits a what-if varies, live. tiny-v4 with
a device pool of one request (--kv-cache-bytes 1 with --max-prompt-tokens 1024 --max-tokens-limit 4: 10 blocks), so
the block ledger, not the engine's device prefix cache, decides what a later request finds."""

from __future__ import annotations

import json
import time

from kvledger.util.serve_process import ServeProcess

SMALL_DEVICE = ("--kv-cache-bytes", "1", "--max-prompt-tokens", "1024", "--max-tokens-limit", "4")


def _cached(server: ServeProcess, first: int) -> int:
    body = {"model": "tiny-v4", "prompt": list(range(first, first + 900)), "max_tokens": 2, "temperature": 0}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _push_out_of_the_device(server: ServeProcess) -> None:
    for first in (20_000, 21_000):   # two other prompts of 7 full blocks take the 10-block pool's room
        _cached(server, first)


def test_a_short_ttl_expires_blocks_while_serving(tmp_path):
    server = ServeProcess(tmp_path / "data", *SMALL_DEVICE, "--ttl-classes", "2s", model="tiny-v4").start()
    try:
        assert _cached(server, 1) == 0
        _push_out_of_the_device(server)
        assert _cached(server, 1) == 640            # from the block ledger (⌊(900 − 134) / 128⌋ · 128)
        time.sleep(3.0)
        _push_out_of_the_device(server)
        assert _cached(server, 1) == 0              # expired in the ledger, gone from the device
        settings = json.loads((tmp_path / "data" / "trace" / "server.json").read_text())
        assert settings["ttl_s"] == {"agent": 2.0, "chatbot": 2.0} and settings["device_blocks"] == 10
    finally:
        server.stop()


def test_a_small_capacity_evicts_while_serving(tmp_path):
    block = 18_816   # tiny-v4's block bytes
    server = ServeProcess(tmp_path / "data", *SMALL_DEVICE, "--store-capacity", str(12 * block),
                          model="tiny-v4").start()
    try:
        assert _cached(server, 1) == 0
        _push_out_of_the_device(server)            # 2 × 7 blocks more than the 12 the ledger keeps
        assert _cached(server, 1) == 0              # the least recently used chain went first
        assert _cached(server, 1) == 640            # written again, found again
    finally:
        server.stop()
