"""Tables for `kvledger bench sim` without `--json` (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

_METRICS = ("block_hit_rate", "token_hit_rate", "ttft_p50_s", "ttft_p99_s", "snapshot_share_of_hits",
            "computed_share", "first_turn_hit_share", "store_gb_max", "evicted_gb", "state_pool_gb")


def _fmt(value: Any) -> str:
    if value is None:
        return "∞"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


_HEADERS = {"ttl_days": "TTL (days)", "ttl_s": "TTL (simulated s)", "capacity_gb": "capacity (GB)",
            "routing": "routing", "swa": "SWA strategy", "block_hit_rate": "block hit rate",
            "token_hit_rate": "token hit rate", "ttft_p50_s": "TTFT p50 (s)", "ttft_p99_s": "TTFT p99 (s)",
            "snapshot_share_of_hits": "snapshot share of hits", "computed_share": "prompt tokens computed",
            "first_turn_hit_share": "first turns that hit",
            "store_gb_max": "store peak (GB)",
            "evicted_gb": "evicted (GB)", "state_pool_gb": "host snapshots (GB)"}


def _cell(col: str, value: Any) -> str:
    if value is None:
        return "none" if col.startswith("ttl") else "∞"
    if col.endswith("_rate") or col == "snapshot_share_of_hits":
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"
    return str(value)


def sweep_markdown(report: dict[str, Any]) -> str:
    """A sweep as a Markdown table (what docs/simulator.md shows), with its reuse ceiling."""
    cols = [*report["columns"], *_METRICS]
    lines = [f"sweep {report['sweep']}: {report['source']}, {report['requests']} requests, "
             f"reuse ceiling {report['reuse_ceiling']:.3f}", "",
             "| " + " | ".join(_HEADERS[c] for c in cols) + " |",
             "|" + "|".join("---:" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(c, row.get(c)) for c in cols) + " |" for row in report["rows"]]
    return "\n".join(lines)


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console(width=120)
    a = report["assumptions"]
    console.print(f"[bold]{report['source']}[/]: {report['requests']} requests, model {a['model']}, "
                  f"{a['prefill_engines']} prefill + {a['decode_engines']} decode engines")
    console.print(f"prefill {a['prefill_tokens_per_s']:.0f} tok/s ({a['prefill_tps_source']}); "
                  f"fetch {a['fetch_bytes_per_s'] / 1e9:.3g} GB/s ({a['fetch_source']}); "
                  f"span {a['span_s']:.0f} s = {a['span_days']:g} days")
    if "sweep" in report:
        print(sweep_markdown(report))
        return
    table = Table(show_header=True)
    table.add_column("figure")
    table.add_column("kvledger", justify="right")
    table.add_column("no cache (baseline)", justify="right")
    table.add_row("block hit rate", _fmt(report["block_hit_rate"]), "0")
    table.add_row("token hit rate", _fmt(report["token_hit_rate"]), "0")
    table.add_row("reuse ceiling", _fmt(report["reuse_ceiling"]), "")
    table.add_row("TTFT p50 (s)", _fmt(report["ttft_p50_s"]), _fmt(report["baseline_ttft_p50_s"]))
    table.add_row("TTFT p99 (s)", _fmt(report["ttft_p99_s"]), _fmt(report["baseline_ttft_p99_s"]))
    table.add_row("snapshot share of hits", _fmt(report["snapshot_share_of_hits"]), "")
    table.add_row("hit kinds", ", ".join(f"{k} {v}" for k, v in report["hit_kinds"].items() if v), "")
    peak = report["store_bytes_max"]
    table.add_row("store size max (GB)", _fmt(None if peak is None else peak / 1e9), "")
    table.add_row("host snapshots (GB)", _fmt(report["state_pool_bytes"] / 1e9), "")
    table.add_row("prefill utilization", _fmt(report["prefill_utilization"]), "")
    console.print(table)
