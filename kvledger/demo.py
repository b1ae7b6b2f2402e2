"""`kvledger demo`: the main job, shown on built-in examples.

Today it plans a DeepSeek-V4.1-Flash cache tier, walks the hit rule through DESIGN.md's
worked example, and diffs two agent prompts that differ only in a timestamp. The
engine and the server land in later issues; the demo grows with them.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from kvledger.core import ModelSpec, decide_hit, diff_prompts, plan
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


def run_demo(console: Console) -> None:
    spec = ModelSpec.preset("deepseek-v4.1-flash")
    console.rule("[bold]kvledger demo")
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
        from kvledger.entrypoint.tokenizer import TokenizerError, load_tokenizer

        tok = load_tokenizer("smollm2")
    except (ImportError, TokenizerError) as e:
        console.print(f"[yellow]skipped: no tokenizer ({e})")
    else:
        a = tok.encode(agent_prompt("2026-11-29T10:21:04Z")).ids
        b = tok.encode(agent_prompt("2026-11-29T10:25:37Z")).ids
        diff_view(diff_prompts(a, b, spec), a, b, spec.name, console, decode=tok.decode)

    console.print("\n[bold]Coming next[/bold] (open issues): the block ledger on disk and Redis, the state "
                  "ledger with pulls between machines, the cluster simulator, then the reference engine "
                  "and the OpenAI-compatible server that serve real prompts from both ledgers.")
