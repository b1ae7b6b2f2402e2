"""`kvledger demo`: the main job, shown on built-in examples.

Today it plans a DeepSeek-V4.1-Flash cache tier, walks the hit rule through DESIGN.md's
worked example, diffs two agent prompts that differ only in a timestamp, serves a second
conversation turn from both ledgers (blocks on disk across a restart, the snapshot pulled
from another "machine" over TCP), and replays the Mooncake trace through the simulator.
It starts with the main job: a multi-turn chat with SmolLM2-135M on the reference engine
(`demo/chat.py`); the later parts use KV stand-ins of the right size.
"""

from __future__ import annotations

import hashlib
import secrets
import tempfile
import time

from rich.console import Console
from rich.table import Table

from kvledger.core import ModelSpec, chain_keys, decide_hit, diff_prompts, lookup_hit, plan, prefill_store_positions
from kvledger.core.spec import PUBLISHED_MODEL
from kvledger.demo.prompts import agent_prompt
from kvledger.util.render import diff_view, plan_table

def run_demo(console: Console, chat_turns: int = 3) -> None:
    spec = ModelSpec.preset(PUBLISHED_MODEL)
    console.rule("[bold]kvledger demo")
    if chat_turns > 0:
        from kvledger.demo.chat import chat_demo

        console.print("0. A chat with SmolLM2-135M on the reference engine, its KV kept on the embedded block ledger:")
        chat_demo(console, chat_turns)
        console.print()
    console.print("1. What a cache tier for DeepSeek-V4.1-Flash costs and buys (kvledger plan):")
    plan_table(plan(spec, 131072), console)

    console.print("\n2. The hit rule on DESIGN.md's worked example (L = 131,072, every block cached):")
    t = Table("state ledger", "hit tokens", "computed from", "window truncated at", "kind")
    for label, snaps, replay in (("snapshot at L1", {130816}, False), ("no snapshot", set(), False),
                                 ("no snapshot, replay on", set(), True)):
        d = decide_hit(131072, 1024, snaps, spec, replay=replay)
        t.add_row(label, f"{d.hit_tokens:,}", f"{d.recompute_from:,}",
                  "-" if d.truncate_from is None else f"{d.truncate_from:,}", d.kind.value)
    console.print(t)

    console.print("\n3. Why a prompt misses: two agent prompts that differ only in a timestamp (kvledger diff):")
    try:
        from kvledger.engine.models.registry import DEFAULT_MODEL, load_tokenizer
        from kvledger.engine.models.tokenizer import TokenizerError

        tok = load_tokenizer(DEFAULT_MODEL)
    except (ImportError, TokenizerError) as e:
        console.print(f"[yellow]skipped: no tokenizer ({e})")
        return
    turn1 = tok.encode(agent_prompt("2026-11-29T10:21:04Z")).ids
    other = tok.encode(agent_prompt("2026-11-29T10:25:37Z")).ids
    diff_view(diff_prompts(turn1, other, spec), turn1, other, spec.name, console, decode=tok.decode)

    turn2 = turn1 + tok.encode("<|im_start|>user\nThe CI job `unit-tests` fails on main since this morning. "
                               "Find the commit that broke it, explain why, and open a pull request that "
                               "fixes it with a regression test.<|im_end|>\n").ids
    console.print(f"\n4. Turn 2 of that conversation ({len(turn2):,} tokens) served from both ledgers:")
    _two_ledgers(console, spec, turn1, turn2)

    console.print("\n5. At cluster scale: the Mooncake synthetic trace through the simulator (kvledger bench sim):")
    _simulate(console, spec)

    console.print("\n[bold]Try next[/bold]: `kvledger serve` (one process, OpenAI-compatible) or "
                  "`kvledger up --prefill 2 --decode 1` (a cluster on Redis: the hit decided before routing).")


def _stand_in_kv(key: bytes, size: int) -> bytes:
    """Deterministic bytes of a block's size, derived from its key (no engine computes real KV yet)."""
    return (hashlib.sha256(key).digest() * (size // 32 + 1))[:size]


def _two_ledgers(console: Console, spec: ModelSpec, turn1: list[int], turn2: list[int]) -> None:
    from kvledger.state import StateLedger
    from kvledger.state.directory import MemoryDirectory
    from kvledger.store.ledger import BlockLedger

    b = spec.block_size
    t = Table("step", "what happened")
    token = secrets.token_hex(16)
    directory = MemoryDirectory()  # one process here; RedisDirectory for several machines
    with tempfile.TemporaryDirectory(prefix="kvledger-demo-") as root, \
            StateLedger(spec, token=token, directory=directory, capacity_bytes=64 << 20,
                        engine_id="engine-a") as engine_a, \
            StateLedger(spec, token=token, directory=directory, capacity_bytes=64 << 20,
                        engine_id="engine-b") as engine_b, \
            StateLedger(spec, token=token, directory=directory, capacity_bytes=0) as entrypoint:
        # turn 1 on engine A: its full blocks go to the block ledger, its window to A's memory
        keys1 = chain_keys(turn1, spec)
        with BlockLedger.open(path=root) as store:
            store.put_chain(keys1, [_stand_in_kv(k, spec.block_bytes()) for k in keys1])
        positions = prefill_store_positions(len(turn1), spec)  # rule 4: its own cap, and the last boundary
        windows = {p: _stand_in_kv(keys1[p // b - 1] + b"swa", spec.state_size_to_disk()) for p in positions}
        for p, window in windows.items():
            engine_a.put(keys1[p // b - 1], p, window)
        t.add_row("turn 1 on engine A", f"{len(keys1)} blocks × {spec.block_bytes():,} B written to disk; "
                                        f"snapshots at {' and '.join(f'{p:,}' for p in positions)} "
                                        f"({spec.state_size_to_disk():,} B each) kept in A's memory")

        # turn 2: the entrypoint decides from metadata alone, after the store restarted
        t0 = time.perf_counter()
        with BlockLedger.open(path=root) as store:
            reopen_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            keys2, cached = store.match_tokens(turn2, spec)
            d = lookup_hit(len(turn2), cached, lambda at: entrypoint.positions(keys2, at=at), spec).decision
            check_ms = (time.perf_counter() - t0) * 1e3
            t.add_row("block ledger restarted", f"index rebuilt from segment headers in {reopen_ms:.1f} ms")
            t.add_row("CHECK at the entrypoint", f"{cached} leading blocks stored, snapshot at {d.block_hit_tokens:,}: "
                                                 f"{d.kind.value} hit of {d.hit_tokens:,} tokens, "
                                                 f"compute from {d.recompute_from:,} ({check_ms:.2f} ms, no KV read)")
            # engine B serves it: blocks from storage, the window pulled from engine A over TCP
            n = d.block_hit_tokens // b
            bufs = [bytearray(spec.block_bytes()) for _ in range(n)]
            got = store.read_prefix(keys2[:n], bufs)
            exact = all(bytes(buf) == _stand_in_kv(k, spec.block_bytes()) for buf, k in zip(bufs, keys2))
            t.add_row("engine B reads blocks", f"{got} of {n} blocks read back, checksums verified, "
                                               f"bytes {'identical' if exact else 'DIFFERENT'}")
        t0 = time.perf_counter()
        pulled = engine_b.fetch(keys2[d.block_hit_tokens // b - 1]) if d.swa_hit else None
        pull_ms = (time.perf_counter() - t0) * 1e3
        ok = pulled is not None and bytes(pulled) == windows.get(d.block_hit_tokens)
        t.add_row("engine B pulls the window", f"{len(pulled or b''):,} B from engine A at {engine_a.address} in "
                                               f"{pull_ms:.1f} ms, {'byte-exact' if ok else 'MISSING'}")
        t.add_row("left to compute", f"{len(turn2) - d.recompute_from:,} of {len(turn2):,} prompt tokens")
    console.print(t)


def _simulate(console: Console, spec: ModelSpec) -> None:
    from kvledger.bench.sim_core import SimConfig, percentile, reuse_ceiling, simulate
    from kvledger.bench.trace import DEFAULT_TRACE, read_trace

    if not DEFAULT_TRACE.is_file():
        console.print(f"[yellow]skipped: no trace at {DEFAULT_TRACE}")
        return
    trace = read_trace(DEFAULT_TRACE)
    cfg = SimConfig(spec=spec)
    res, base = simulate(trace.requests, cfg), simulate(trace.requests, SimConfig(spec=spec, capacity_bytes=0.0))
    t = Table("", "kvledger", "no cache tier")
    t.add_row("block hit rate", f"{res.block_hit_rate:.3f} (ceiling {reuse_ceiling(trace.requests):.3f})", "0")
    for q in (50, 99):
        t.add_row(f"TTFT p{q}", f"{percentile(res.ttft_s, q):.3f} s", f"{percentile(base.ttft_s, q):.3f} s")
    console.print(f"{len(trace):,} requests, 8 prefill engines, one shared store without limit or expiry "
                  "(more in `kvledger bench sim`)")
    console.print(t)
