"""The demo's main job: a multi-turn chat with SmolLM2-135M, served by `kvledger serve` on its embedded ledgers.

The demo is a client of the same path every user's request takes: it starts `kvledger serve` on a
fresh data dir and sends each turn to `/v1/chat/completions` (streamed). Each turn prints the reply,
the prompt tokens the block ledger served (`cached_tokens`) and the TTFT on that hit next to the TTFT
of the same prompt computed cold (sent with a `cache_salt` of its own, so nothing is cached for it).
Then the server is stopped and started again on the same data dir, as after a restart, and the last
prompt is sent again: it still hits.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvledger.bench.serve_client import Reply, stream_chat
from kvledger.demo.prompts import PREAMBLE
from kvledger.engine.models.registry import DEFAULT_MODEL as MODEL
from kvledger.util.serve_process import ServeProcess

SYSTEM = PREAMBLE + (
    "\nYou are also a concise assistant for engineers who run language model services. "
    "Answer in two or three sentences, plainly. The service keeps the key-value cache of every prompt "
    "in a shared store, so that a prompt which starts like an earlier one skips that part of the "
    "prefill. Its blocks are 128 tokens long, found by chain keys that depend on the whole prefix.")
QUESTIONS = ("What is a KV cache, in one sentence?",
             "Why does a timestamp at the start of a prompt make the cache miss?",
             "Give one way to avoid that.")


def chat_demo(console: Console, turns: int = 3, max_tokens: int = 40) -> None:
    with tempfile.TemporaryDirectory(prefix="kvledger-demo-") as top:
        data_dir = Path(top) / "data"
        server = ServeProcess(data_dir, "--max-num-seqs", "2", model=MODEL).start()
        try:
            messages = _turns(console, server.url, turns, max_tokens)
        finally:
            server.stop()
        console.print("Restart: the server stopped and started again on the same data dir.")
        server = ServeProcess(data_dir, "--max-num-seqs", "2", model=MODEL).start()
        try:
            again = stream_chat(server.url, MODEL, messages, 1)
        finally:
            server.stop()
        console.print(f"After the restart the last prompt ({again.prompt_tokens:,} tokens) still hits: "
                      f"{again.cached_tokens:,} tokens cached, TTFT {again.ttft_s:.2f} s.")


def _turns(console: Console, url: str, turns: int, max_tokens: int) -> list[dict[str, str]]:
    """The chat's turns on a fresh server; the messages of the last turn's prompt."""
    messages = [{"role": "system", "content": SYSTEM}]
    table = Table("turn", "prompt tokens", "cached", "TTFT hit s", "TTFT cold s", title="chat, SmolLM2-135M")
    for i, question in enumerate(QUESTIONS[:turns], 1):
        messages.append({"role": "user", "content": question})
        turn: Reply = stream_chat(url, MODEL, messages, max_tokens)
        cold = stream_chat(url, MODEL, messages, 1, cache_salt=f"demo-cold-{i}")
        console.print(f"[bold]user[/bold]: {question}\n[bold]SmolLM2[/bold]: {turn.text.strip()}")
        console.print(f"   {turn.cached_tokens:,} of {turn.prompt_tokens:,} prompt tokens cached; TTFT "
                      f"{turn.ttft_s:.2f} s vs {cold.ttft_s:.2f} s cold")
        table.add_row(str(i), f"{turn.prompt_tokens:,}", f"{turn.cached_tokens:,}", f"{turn.ttft_s:.2f}",
                      f"{cold.ttft_s:.2f}")
        messages.append({"role": "assistant", "content": turn.text})   # as generated: the next prompt starts with it
    console.print(table)
    return messages[:-1]
