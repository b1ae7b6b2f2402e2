"""The replay's output: one JSON object (`--json`), a table otherwise, and with `--out DIR` the JSON,
per policy the scaled requests as sent, as a trace (`replay_requests_POLICY.jsonl`, which `kvledger
bench sim --trace` reads back), every request's outcome (`replay_outcomes.jsonl`) and a TTFT chart."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvledger.bench.replay_scale import Scaling, ScaledRequest

HEADLINE = ("token_hit_rate", "sim_token_hit_rate", "hit_rate_gap", "ttft_p50_warm_s", "ttft_p50_cold_s",
            "ttft_p99_warm_s", "ttft_p99_cold_s", "requests_per_s", "store_share_of_hits",
            "prefill_tokens_per_s", "prefill_tokens_per_s_idle", "read_bytes_per_s")   # the first policy's, at the top


def report(source: str, scaling: Scaling, requests: list[ScaledRequest], runs: list[dict[str, Any]]
           ) -> dict[str, Any]:
    """The JSON object: headline figures of the first policy at the top, every policy under `policies`."""
    prompts = [r.tokens.size for r in requests]
    scale = {**scaling.describe(), "requests": len(requests), "prompt_tokens": sum(prompts),
             "prompt_tokens_max": max(prompts), "max_tokens_total": sum(r.max_tokens for r in requests),
             "span_s": requests[-1].arrival_s - requests[0].arrival_s}
    policies = [{k: v for k, v in run.items() if k not in ("outcomes", "sim_requests")} for run in runs]
    head = policies[0]
    return {"bench": "replay", "source": source, "routing": head["routing"], **{k: head[k] for k in HEADLINE},
            "scaling": scale, "policies": policies}


def emit(args: argparse.Namespace, source: str, scaling: Scaling, requests: list[ScaledRequest],
         runs: list[dict[str, Any]]) -> None:
    from kvledger.util.output import emit_json

    obj = report(source, scaling, requests, runs)
    if args.out:
        write_out(Path(args.out), obj, requests, runs)
    if args.json:
        emit_json(obj)
    else:
        table(obj)


def write_out(out: Path, obj: dict[str, Any], requests: list[ScaledRequest], runs: list[dict[str, Any]]) -> None:
    from kvledger.bench import plots
    from kvledger.bench.trace import write_trace
    from kvledger.util.output import dumps_strict

    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(dumps_strict(obj, indent=1) + "\n")
    for run in runs:
        write_trace(run["sim_requests"], out / f"replay_requests_{run['routing']}.jsonl")
    with open(out / "replay_outcomes.jsonl", "w") as f:
        for run in runs:
            for o in run["outcomes"]:
                f.write(json.dumps({"routing": run["routing"], **asdict(o)}) + "\n")
    for run in runs:
        ok = [o for o in run["outcomes"] if o.ok]
        series = {"cold (0 cached)": [o.ttft_s for o in ok if o.cached_tokens == 0],
                  "warm (cached > 0)": [o.ttft_s for o in ok if o.cached_tokens > 0]}
        plots.ttft_cdf(out / f"replay_ttft_{run['routing']}.png", {k: v for k, v in series.items() if v})


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def table(obj: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = obj["scaling"]
    t = Table(title=f"kvledger bench replay: {obj['source']}, {s['requests']} requests over {s['span_s']:.0f} s, "
                    f"lengths × {s['length_factor']:.3g}, prompts ≤ {s['max_prompt_tokens']} tokens")
    t.add_column("figure")
    for p in obj["policies"]:
        t.add_column(p["routing"], justify="right")
    rows = ("server", "ok_requests", "errors", "token_hit_rate", "sim_token_hit_rate", "hit_rate_gap",
            "ttft_p50_cold_s", "ttft_p99_cold_s", "ttft_p50_warm_s", "ttft_p99_warm_s", "requests_per_s",
            "prompt_tokens_per_s", "output_tokens_per_s", "store_share_of_hits", "device_share_of_hits",
            "prefill_tokens_per_s", "read_bytes_per_s", "late_sends", "wall_s")
    for key in rows:
        t.add_row(key, *(_fmt(p.get(key)) for p in obj["policies"]))
    Console().print(t)
