"""The demo's main job: a multi-turn chat with SmolLM2-135M on the embedded block ledger.

Each turn prints the reply, the prompt tokens the block ledger served (cached) and the TTFT on
that hit next to the TTFT of the same prompt computed cold (run in a namespace of its own, so
nothing is cached for it). Then the engine and the ledger are closed and reopened on the same
directory, as after a restart, and the last prompt is sent again: it still hits.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from kvledger.demo import _PREAMBLE

SYSTEM = _PREAMBLE + (
    "\nYou are also a concise assistant for engineers who run language model services. "
    "Answer in two or three sentences, plainly. The service keeps the key-value cache of every prompt "
    "in a shared store, so that a prompt which starts like an earlier one skips that part of the "
    "prefill. Its blocks are 128 tokens long, found by chain keys that depend on the whole prefix.")
QUESTIONS = ("What is a KV cache, in one sentence?",
             "Why does a timestamp at the start of a prompt make the cache miss?",
             "Give one way to avoid that.")


def chat_demo(console: Console, turns: int = 3, max_tokens: int = 40) -> None:
    import torch

    from kvledger.engine.engine import Engine
    from kvledger.engine.models import registry
    from kvledger.entrypoint.chat import Chat
    from kvledger.store.ledger import BlockLedger

    if (os.cpu_count() or 1) <= 2:  # a second intra-op thread on 2 shared cores spins more than it helps
        torch.set_num_threads(1)
    model = registry.resolve(registry.DEFAULT_MODEL)
    with tempfile.TemporaryDirectory(prefix="kvledger-demo-") as data_dir:
        last = _turns(console, model, data_dir, turns, max_tokens)
        console.print("Restart: the engine and the ledger closed and reopened on the same directory.")
        ledger = BlockLedger.open(path=data_dir)
        engine = Engine(model, block_ledger=ledger, max_num_seqs=2, kv_cache_bytes=256 << 20)
        try:
            _, again = Chat(engine, ledger, model).run(last, 1)
            console.print(f"After the restart the last prompt ({again.prompt_tokens:,} tokens) still hits: "
                          f"{again.cached_tokens:,} tokens cached, TTFT {again.ttft_s:.2f} s.")
        finally:
            engine.close()
            ledger.close()


def _turns(console: Console, model: Any, data_dir: str, turns: int, max_tokens: int) -> list[int]:
    """The chat's turns on a fresh engine; the last turn's prompt."""
    from kvledger.engine.engine import Engine
    from kvledger.entrypoint.chat import Chat
    from kvledger.store.ledger import BlockLedger

    ledger = BlockLedger.open(path=data_dir)
    engine = Engine(model, block_ledger=ledger, max_num_seqs=2, kv_cache_bytes=256 << 20)
    try:
        chat = Chat(engine, ledger, model, max_tokens=max_tokens)
        chat.messages.append({"role": "system", "content": SYSTEM})
        table = Table("turn", "prompt tokens", "cached", "TTFT hit s", "TTFT cold s", title="chat, SmolLM2-135M")
        for i, question in enumerate(QUESTIONS[:turns], 1):
            turn = chat.say(question)
            _, cold = chat.run(chat.prompt_ids(chat.messages[:-1]), 1, namespace=f"demo-cold-{i}")
            console.print(f"[bold]user[/bold]: {question}\n[bold]SmolLM2[/bold]: {turn.reply.strip()}")
            console.print(f"   {turn.cached_tokens:,} of {turn.prompt_tokens:,} prompt tokens cached; TTFT "
                          f"{turn.ttft_s:.2f} s vs {cold.ttft_s:.2f} s cold")
            table.add_row(str(i), f"{turn.prompt_tokens:,}", f"{turn.cached_tokens:,}", f"{turn.ttft_s:.2f}",
                          f"{cold.ttft_s:.2f}")
        console.print(table)
        return chat.prompt_ids(chat.messages[:-1])
    finally:
        engine.close()
        ledger.close()
