"""The figures of `kvledger bench vllm --model gemma3-270m`, from `hybrid_schedule`'s samples (pure: no I/O).

Per prompt size and role: TTFT cold and hit as median with spread (min, max) over the repeats, the
tokens vLLM reported cached on the hit, each repeat's hit over its cold, and for the connectors their
hit over vLLM's own in-memory prefix-cache hit of the same prompt (the issue's target: kvledger ≤ 1.5×),
the one asked beside theirs in the fresh phase when there is one (the same machine state; vLLM's own
`ttft_hit_s` is its hit right after its cold, `ttft_hit_fresh_phase_s` the later one).
The greedy check compares each role's 16-token hit with the reference: the same prompt computed
cold (`check_cold`). Bytes per cached token: what a store held after a size's prompts, over the tokens
in the blocks it stored (`repeat` × ⌊L/128⌋·128), against an all-layers store (every layer's K and V).
"""

from __future__ import annotations

import statistics
from typing import Any

from kvledger.integrations.vllm.hybrid_schedule import PLAIN

TARGET_OVER_PREFIX_HIT = 1.5
BLOCK = 128


def spread(values: list[float]) -> dict[str, float]:
    """Median and spread of `values` (at least one)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _of(samples: list[dict[str, Any]], role: str, tokens: int, kind: str, phase: str | None = None
        ) -> list[dict[str, Any]]:
    return sorted((s for s in samples if s["role"] == role and s["prompt_tokens"] == tokens and s["kind"] == kind
                   and (phase is None or s.get("phase", "stored") == phase)), key=lambda s: s["repeat"])


def role_row(samples: list[dict[str, Any]], role: str, tokens: int, reference: list[int] | None) -> dict[str, Any]:
    """One role at one size. `reference`: the cold 16 tokens, or None when no reference ran."""
    cold = _of(samples, role, tokens, "cold")
    hit = _of(samples, role, tokens, "hit", "stored" if role == PLAIN else None)
    beside = _of(samples, PLAIN, tokens, "hit", "fresh")   # vLLM's own hits asked beside the fresh processes'
    floor = beside if beside and role != PLAIN else _of(samples, PLAIN, tokens, "hit", "stored")
    plain_hit = {s["repeat"]: s["seconds"] for s in floor}
    cold_by = {s["repeat"]: s for s in cold}
    row: dict[str, Any] = {}
    if cold:
        row["ttft_cold_s"] = spread([s["seconds"] for s in cold])
        row["cold_cpu_s"] = spread([s["cpu_s"] for s in cold])
    if hit:
        row["ttft_hit_s"] = spread([s["seconds"] for s in hit])
        row["hit_cpu_s"] = spread([s["cpu_s"] for s in hit])
        row["hit_tokens"] = min(s["cached"] for s in hit)
        row["first_token_equal_cold"] = all(s["tokens"][:1] == cold_by[s["repeat"]]["tokens"][:1]
                                            for s in hit if s["repeat"] in cold_by)
        pairs = [(s["seconds"], cold_by[s["repeat"]]["seconds"]) for s in hit if s["repeat"] in cold_by]
        if pairs:
            row["hit_over_cold"] = spread([h / c for h, c in pairs])
        if role != PLAIN and plain_hit:
            row["hit_over_vllm_prefix_hit"] = spread([s["seconds"] / plain_hit[s["repeat"]] for s in hit
                                                      if s["repeat"] in plain_hit])
    if role == PLAIN and beside:
        row["ttft_hit_fresh_phase_s"] = spread([s["seconds"] for s in beside])
        row["hit_fresh_phase_cpu_s"] = spread([s["cpu_s"] for s in beside])
    checks = _of(samples, role, tokens, "check_hit")
    if checks and reference is not None:
        row["greedy_16_equal_cold"] = all(s["tokens"] == reference for s in checks)
    return row


def bytes_row(tokens: int, repeat: int, held: dict[str, int], all_layers_per_token: int) -> dict[str, Any]:
    """Bytes per cached token of one size's prompts. `held`: bytes each store gained over the size
    (`kvledger_blocks`, `kvledger_snapshots`, `mooncake`; a key absent when that store did not run)."""
    stored = repeat * (tokens // BLOCK) * BLOCK
    row: dict[str, Any] = {"prompt_tokens": tokens, "stored_tokens": stored, "all_layers": all_layers_per_token}
    if "kvledger_blocks" in held:
        total = held["kvledger_blocks"] + held.get("kvledger_snapshots", 0)
        row.update(kvledger=total / stored, kvledger_blocks=held["kvledger_blocks"] / stored,
                   kvledger_snapshots=held.get("kvledger_snapshots", 0) / stored,
                   kvledger_over_all_layers=total / stored / all_layers_per_token)
    if "mooncake" in held:
        row.update(mooncake=held["mooncake"] / stored, mooncake_over_all_layers=held["mooncake"] / stored
                   / all_layers_per_token)
    return row


def connector_times(events: list[dict[str, Any]], tokens: int) -> dict[str, float]:
    """kvledger's own time in its copier thread for prompts of `tokens` (from its event log): medians of a
    hit's block load and window load, of a cold prompt's block saves (summed per request) and window save,
    and of the time the forward waited for a load (`load_waited_s`: what the load did not hide)."""
    hit_blocks, stored_blocks, position = (tokens - 1) // BLOCK, tokens // BLOCK, (tokens - 1) // BLOCK * BLOCK
    loads = [e for e in events if e["event"] == "load" and e["ok"] == hit_blocks]
    saves: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "save":
            saves.setdefault(e["req_id"], []).append(e)
    saved = [sum(e["seconds"] for e in run) for run in saves.values() if sum(e["ok"] for e in run) == stored_blocks]
    windows = {kind: [e["seconds"] for e in events if e["event"] == kind and e["ok"] and e["position"] == position]
               for kind in ("window_load", "window_save")}
    out: dict[str, float] = {}
    for key, values in (("load_s", [e["seconds"] for e in loads]), ("load_waited_s", [e.get("waited_s", 0.0)
                        for e in loads]), ("save_s", saved), ("window_load_s", windows["window_load"]),
                        ("window_save_s", windows["window_save"])):
        if values:
            out[key] = statistics.median(values)
    return out


def summarize(samples: list[dict[str, Any]], sizes: list[int], repeat: int, roles: list[str],
              failures: dict[str, str], held: dict[int, dict[str, int]], all_layers_per_token: int,
              events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report: one row per size (each role's figures, or its failure), bytes per cached token, the target.
    `events`: kvledger's event log, for its copier thread's times (`connector_times`)."""
    rows, byte_rows, target = [], [], {}
    for tokens in sizes:
        refs = _of(samples, PLAIN, tokens, "check_cold")
        reference = refs[0]["tokens"] if refs else None
        row: dict[str, Any] = {"prompt_tokens": tokens, "greedy_reference": reference}
        for role in roles:
            row[role] = {"failed": failures[role]} if role in failures else role_row(samples, role, tokens, reference)
        if events and "failed" not in row.get("kvledger", {"failed": ""}):
            row["kvledger"]["connector_times"] = connector_times(events, tokens)
        rows.append(row)
        byte_rows.append(bytes_row(tokens, repeat, held.get(tokens, {}), all_layers_per_token))
        ratio = row.get("kvledger", {}).get("hit_over_vllm_prefix_hit")
        if ratio is not None:
            target[str(tokens)] = {"kvledger_hit_over_vllm_prefix_hit": ratio["median"],
                                   "met": ratio["median"] <= TARGET_OVER_PREFIX_HIT}
    return {"rows": rows, "bytes_per_cached_token": byte_rows, "failures": failures,
            "target": {"kvledger_hit_over_vllm_prefix_hit_at_most": TARGET_OVER_PREFIX_HIT, "by_size": target}}


def _cell(row: dict[str, Any], key: str, fmt: str = "{:.2f}") -> str:
    value = row.get(key)
    if value is None:
        return "-"
    m = value["median"]
    return f"{fmt.format(m)} ({fmt.format(value['min'])}–{fmt.format(value['max'])})"


LABELS = {"vllm": "vLLM prefix cache (same process)", "kvledger": "kvledger (fresh process)",
          "mooncake": "MooncakeStore (fresh process)",
          "simple_cpu_offload_disk": "SimpleCPUOffload disk (same process)"}


def table_lines(report: dict[str, Any]) -> list[list[str]]:
    """Rows for a table: size, role, cold s, hit s, hit tokens, hit / cold, hit / vLLM hit, greedy 16 = cold."""
    out = []
    for row in report["rows"]:
        for role, label in LABELS.items():
            if role not in row:
                continue
            r = row[role]
            if "failed" in r:
                out.append([f"{row['prompt_tokens']:,}", label, "failed: " + r["failed"][:90], "", "", "", "", ""])
                continue
            equal = r.get("greedy_16_equal_cold")
            out.append([f"{row['prompt_tokens']:,}", label, _cell(r, "ttft_cold_s"), _cell(r, "ttft_hit_s"),
                        f"{r.get('hit_tokens', 0):,}", _cell(r, "hit_over_cold", "{:.3f}"),
                        _cell(r, "hit_over_vllm_prefix_hit"), "-" if equal is None else str(equal)])
    return out
