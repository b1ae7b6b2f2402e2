"""`kvledger serve` keeps exact hits across a restart (issue 20 item 2): its state ledger writes each
snapshot beside the blocks (`<data>/blocks/snapshots`, state/files.py) as well as to memory, so after a
restart a prompt seen before resumes from its snapshot, with the cold reply's greedy tokens. Before,
the snapshots lived in memory only: hits after a restart fell back (wrong tokens, before rule 3′) or
replayed."""

from __future__ import annotations

import random

from kvledger.util.serve_process import ServeProcess


def complete(server: ServeProcess, prompt: list[int]) -> tuple[list[int], dict]:
    status, out = server.post("/v1/completions", {"model": "tiny-v4", "prompt": prompt, "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    return out["choices"][0]["token_ids"], out["usage"]["kvledger"]


def test_a_restart_keeps_exact_snapshot_hits(tmp_path):
    rng = random.Random(20)
    prompts = [[rng.randrange(3, 30000) for _ in range(n)] for n in (300, 420, 650)]
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        cold = [complete(server, p)[0] for p in prompts]
    finally:
        server.stop()
    assert list((tmp_path / "data" / "blocks" / "snapshots").rglob("*.snap"))
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        warm = [complete(server, p) for p in prompts]
    finally:
        server.stop()
    assert [ids for ids, _ in warm] == cold
    assert [usage["hit_kind"] for _, usage in warm] == ["snapshot"] * 3, warm
