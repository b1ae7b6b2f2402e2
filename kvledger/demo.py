"""`kvledger demo`: the main job, shown on built-in examples.

Today it plans a DeepSeek-V4.1-Flash cache tier, walks the hit rule through DESIGN.md's
worked example, diffs two agent prompts that differ only in a timestamp, serves a second
conversation turn from both ledgers (blocks on disk across a restart, the snapshot pulled
from another "machine" over TCP), and replays the Mooncake trace through the simulator.
It starts with the main job: a multi-turn chat with SmolLM2-135M on the reference engine
(`demo_chat`); the later parts use KV stand-ins of the right size.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import tempfile
import time

from rich.console import Console
from rich.table import Table

from kvledger.core import ModelSpec, chain_keys, decide_hit, diff_prompts, hit_cap, plan, prefill_store_positions
from kvledger.core.spec import PUBLISHED_MODEL
from kvledger.render import diff_view, plan_table

_PREAMBLE = (
    "You are Atlas, an engineering agent that works inside a company's monorepo. You read code, run "
    "commands in a sandbox, and open pull requests. Follow these rules on every turn. Think about the "
    "user's goal before acting, and prefer the smallest change that reaches it. Never invent file paths: "
    "list a directory before you read from it. When a command fails, read its error output in full, form "
    "one hypothesis, and test it with one command. Keep secrets out of logs, commits and messages. When you "
    "are unsure what the user wants, ask one short question instead of guessing. Cite the files and lines "
    "you relied on. Write tests for behaviour you change, and run them before you say you are done. "
    "Summaries are short: what changed, why, and how it was checked. Do not apologise; fix. "
    "Respect the repository's style guide, its linters and its review rules. Large changes are split "
    "into steps that each build and pass their tests. Prefer reading the tests of a module before its code: "
    "they say what the module promises. Do not touch generated files, vendored code or lock files unless the "
    "task is about them. When two approaches are close, pick the one that is easier to revert. "
)

_TOOLS = [
    ("read_file", "Read a file of the repository", {"path": "string", "start_line": "integer", "end_line": "integer"}),
    ("list_dir", "List a directory", {"path": "string", "depth": "integer"}),
    ("search_code", "Search the code for a regular expression", {"pattern": "string", "glob": "string"}),
    ("run_command", "Run a shell command in the sandbox", {"command": "string", "timeout_s": "integer"}),
    ("write_file", "Write a file", {"path": "string", "content": "string"}),
    ("apply_patch", "Apply a unified diff", {"patch": "string"}),
    ("run_tests", "Run a test target", {"target": "string", "filter": "string"}),
    ("git_status", "Show the working tree status", {}),
    ("git_diff", "Show a diff against a revision", {"revision": "string", "path": "string"}),
    ("git_log", "Show the history of a path", {"path": "string", "limit": "integer"}),
    ("open_pull_request", "Open a pull request", {"title": "string", "body": "string", "branch": "string"}),
    ("comment", "Comment on a pull request", {"pr": "integer", "body": "string"}),
    ("fetch_issue", "Read an issue", {"id": "integer"}),
    ("list_issues", "List open issues", {"label": "string", "limit": "integer"}),
    ("query_metrics", "Query the metrics store", {"expr": "string", "range": "string"}),
    ("read_logs", "Read service logs", {"service": "string", "since": "string", "grep": "string"}),
    ("deploy_preview", "Deploy a preview environment", {"branch": "string"}),
    ("ask_user", "Ask the user a question", {"question": "string"}),
]


def agent_prompt(timestamp: str) -> str:
    """An agent system prompt (~2,000 SmolLM2 tokens) with a timestamp after ~300 tokens:
    the mistake that makes prompt caches miss."""
    tools = [{"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {k: {"type": v, "description": f"The {k.replace('_', ' ')}."}
                                                        for k, v in params.items()},
                       "required": list(params)[:1]}}} for name, desc, params in _TOOLS]
    return (_PREAMBLE + f"\nCurrent date and time: {timestamp}\n\n# Tools\n"
            + "\n".join(json.dumps(t, indent=2) for t in tools)
            + "\n\n# Task\nThe user will describe a task next. Plan, then act.\n")


def run_demo(console: Console, chat_turns: int = 3) -> None:
    spec = ModelSpec.preset(PUBLISHED_MODEL)
    console.rule("[bold]kvledger demo")
    if chat_turns > 0:
        from kvledger.demo_chat import chat_demo

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
            l1 = min(cached * b, hit_cap(len(turn2), spec))
            d = decide_hit(len(turn2), cached, entrypoint.positions(keys2, at={l1}), spec)
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
