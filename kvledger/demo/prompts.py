"""The demo's prompt text: an agent's system prompt (rules, then a tool list), with or without a timestamp."""

from __future__ import annotations

import json

PREAMBLE = (
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

TOOLS = [
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
                       "required": list(params)[:1]}}} for name, desc, params in TOOLS]
    return (PREAMBLE + f"\nCurrent date and time: {timestamp}\n\n# Tools\n"
            + "\n".join(json.dumps(t, indent=2) for t in tools)
            + "\n\n# Task\nThe user will describe a task next. Plan, then act.\n")
