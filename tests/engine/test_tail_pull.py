"""The decode engine's pull of a P/D tail (`EngineProcess.pull_tail`): a proven one of the right size raises the
hit to the last token; one from an engine that cannot serve it is a recompute (the request as it came), never a
failure, and never bytes the caller cannot prove. A windowed model's tail carries its windows (Gemma 3), and its
decision's L1 stops at a snapshot, so the engine asks its block index how many blocks the tail follows."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import numpy as np
import pytest

from kvledger.core import ModelSpec, chain_keys, decide_hit, tail_parts
from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.engine.process import EngineProcess
from kvledger.engine.session import H_MAC, H_SEQ, H_SESSION, SessionClient, SessionTable
from kvledger.engine.wire import GenerateBody

TOKEN = "t" * 64
SPEC = ModelSpec.preset("smollm2-135m")
GEMMA = ModelSpec.preset("gemma3-270m")
TOKENS = list(range(100, 401))   # a prompt of 300 and its first output token: blocks 0, 1 and a tail of 44


class TailServer:
    """An engine's session endpoint with the cluster token, and a tail endpoint answering as `mode` says:
    "good" (the right MAC), "forged" (a wrong one), "short" (one byte too few), "absent" (404)."""

    def __init__(self, mode: str, token: str = TOKEN, spec: ModelSpec = SPEC) -> None:
        table, size = SessionTable(token), sum(tail_parts(len(TOKENS), spec))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self._send(200, json.dumps(table.open(body["client_nonce"])).encode(), {})

            def do_GET(self) -> None:
                h = self.headers
                assert table.check(h[H_SESSION], h[H_SEQ], h[H_MAC], "GET", self.path, b"") is None
                if mode == "absent":
                    return self._send(404, b"{}", {})
                kv = bytes(size - (mode == "short"))
                tag = table.reply_mac(h[H_SESSION], int(h[H_SEQ]), self.path, kv if mode != "forged" else b"x")
                self._send(200, kv, {H_MAC: tag})

            def _send(self, status: int, raw: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in {**headers, "content-length": str(len(raw))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def pull(url: str, spec: ModelSpec = SPEC, *, decision=None, block_ledger=None, pulls: int = 1) -> EngineRequest:
    """`pull_tail` of a decode leg over TOKENS whose tail lies at `url` (a process with only what it needs); the
    decision of blocks 0 and 1 present unless given. It must try `pulls` pulls (0: the tail is of no use)."""
    proc = EngineProcess.__new__(EngineProcess)
    proc.spec, proc.tail_sessions, proc.tail_client, proc.tail_pulls = spec, SessionClient(TOKEN), None, {}
    proc.block_ledger = block_ledger
    keys = chain_keys(np.asarray(TOKENS, dtype=np.uint32), spec)
    decision = decision or decide_hit(len(TOKENS), 2, {256}, spec)
    req = EngineRequest("r.2", TOKENS, keys, decision, SamplingParams(max_tokens=4))
    body = GenerateBody.of(req, tail_from=url)

    async def run() -> EngineRequest:
        try:
            return await proc.pull_tail(body, req)
        finally:
            if proc.tail_client is not None:
                await proc.tail_client.aclose()

    got = asyncio.run(run())
    assert sum(proc.tail_pulls.values()) == pulls
    return got


def test_a_proven_tail_raises_the_hit_to_the_last_token():
    got = pull(TailServer("good").url)
    assert got.decision.hit_tokens == 300 and got.tail_kv == bytes(SPEC.block_bytes())


@pytest.mark.parametrize("mode", ["forged", "short", "absent"])
def test_a_tail_that_cannot_be_proven_or_is_absent_is_recomputed(mode):
    got = pull(TailServer(mode).url)
    assert got.decision.hit_tokens == 256 and got.tail_kv is None


def test_an_engine_without_the_token_or_no_engine_at_all_costs_a_recompute():
    assert pull(TailServer("good", token="x" * 64).url).tail_kv is None   # its session proof fails
    free = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    port = free.server_address[1]
    free.server_close()   # nothing listens there now: refused at once
    assert pull(f"http://127.0.0.1:{port}").decision.hit_tokens == 256


def test_a_windowed_tail_carries_the_windows_and_follows_the_blocks_the_index_holds(tmp_path):
    """Gemma 3: the tail is the block part and the 15 windows at 300. With the snapshot at 256 the decision shows
    blocks 0 and 1; without it (an exact replay from 0) the engine asks its index, which holds both, or one."""
    from kvledger.store.ledger import BlockLedger

    got = pull(TailServer("good", spec=GEMMA).url, GEMMA)
    assert (got.decision.kind.value, got.decision.hit_tokens) == ("snapshot", 300)
    assert len(got.tail_kv) == GEMMA.block_bytes() + GEMMA.state_size_to_disk()
    keys = chain_keys(np.asarray(TOKENS, dtype=np.uint32), GEMMA)
    no_snapshot = decide_hit(len(TOKENS), 2, set(), GEMMA)
    assert no_snapshot.block_hit_tokens == 0
    with BlockLedger.open(tmp_path / "blocks") as ledger:
        ledger.put_chain(keys[:1], [np.zeros(GEMMA.block_bytes(), np.uint8)])
        got = pull(TailServer("good", spec=GEMMA).url, GEMMA, decision=no_snapshot, block_ledger=ledger, pulls=0)
        assert got.tail_kv is None and got.decision == no_snapshot   # block 1 missing: not pulled, recomputed
        ledger.put_chain(keys[1:2], [np.zeros(GEMMA.block_bytes(), np.uint8)], start_pos=1, parent=keys[0])
        got = pull(TailServer("good", spec=GEMMA).url, GEMMA, decision=no_snapshot, block_ledger=ledger)
        assert got.decision.hit_tokens == 300 and got.tail_kv is not None
