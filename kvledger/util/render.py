"""What `kvledger plan` and `kvledger diff` print: one JSON object, or rich tables for people."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvledger.core import CapacityPlan, PromptDiff

CONTEXT_TOKENS = 8  # tokens shown on each side of a divergence


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_s(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


# --- plan ------------------------------------------------------------------------

def plan_json(p: CapacityPlan) -> dict[str, Any]:
    out = asdict(p)
    out["fetch_gbps"] = p.link.fetch_bytes_per_s / 1e9
    return out


def plan_table(p: CapacityPlan, console: Console) -> None:
    t = Table(title=f"capacity plan: {p.model}, {p.prompt_tokens:,}-token prompt", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    rows = [
        ("block", f"{p.block_size} tokens = {p.block_bytes:,} B", human_bytes(p.block_bytes)),
        ("prompt KV (full blocks)", f"{p.blocks_per_prompt:,} blocks", human_bytes(p.prompt_kv_bytes)),
        ("hit-eligible tokens", f"{p.hit_eligible_tokens:,}",
         f"rule 3 cap: the last R = {p.reserve_tokens:,} prompt tokens are always computed"),
        *_swa_rows(p),
        ("written per day", human_bytes(p.bytes_written_per_day),
         f"{p.traffic.requests_per_day:,.0f} req/day, {p.traffic.reuse:.0%} of prompt tokens reused"),
    ]
    for cls, nbytes in p.storage_bytes_by_class.items():
        rows.append((f"storage: {cls}", human_bytes(nbytes),
                     f"{p.traffic.mix[cls]:.0%} of traffic × TTL {p.traffic.ttl_days[cls]:g} d"))
    rows += [
        ("storage: total", human_bytes(p.storage_bytes), "steady state"),
        ("fetch eligible prefix", human_s(p.fetch_s), f"at {p.link.fetch_bytes_per_s / 1e9:g} GB/s"),
        ("prefill (no hit)", human_s(p.prefill_s), _prefill_note(p)),
        ("TTFT on a hit", human_s(p.ttft_hit_s), f"{p.speedup:,.1f}× faster (first order: fetch + suffix)"),
        ("break-even prefix", "never" if p.break_even_tokens is None else f"{p.break_even_tokens:,} tokens",
         "shorter cached prefixes are not worth fetching"),
    ]
    for r in rows:
        t.add_row(*r)
    console.print(t)


def _prefill_note(p: CapacityPlan) -> str:
    source = p.prefill_source
    if source != "--prefill-tps":
        source += "; --prefill-tps overrides"
    return f"at {p.link.prefill_tokens_per_s:,.0f} tokens/s ({source})"


def _swa_rows(p: CapacityPlan) -> list[tuple[str, str, str]]:
    """The state ledger's rows: the snapshot and the rings, or one line saying there are none."""
    if not p.has_swa:
        return [("SWA snapshot", "none", "no sliding-window layers: no snapshot, no rings")]
    assert p.swa_snapshot_bytes is not None
    return [("SWA snapshot", f"{p.swa_snapshot_bytes:,} B", human_bytes(p.swa_snapshot_bytes)),
            ("rings", f"{p.inference_ring} / {p.kvstore_ring}", "inference / prefill kvstore (tokens)")]


# --- diff ------------------------------------------------------------------------

def _span_text(tokens: Sequence[int], span: tuple[int, int], decode) -> str | None:
    if decode is None:
        return None
    return decode(list(tokens[span[0]:span[1]]))


def diff_json(d: PromptDiff, a: Sequence[int], b: Sequence[int], model: str, decode=None) -> dict[str, Any]:
    dec = d.decision
    out: dict[str, Any] = {
        "model": model,
        "len_a": d.len_a,
        "len_b": d.len_b,
        "first_divergence": d.first_divergence,
        "hit_blocks": d.hit_blocks,
        "blocks_a": d.cached_blocks_a,
        "blocks_b": d.blocks_b,
        "hit_tokens": dec.hit_tokens,
        "block_hit_tokens": dec.block_hit_tokens,
        "hit_kind": dec.kind.value,
        "cap": dec.cap,
        "a_span": list(d.a_span),
        "b_span": list(d.b_span),
        "recoverable_blocks": d.recoverable_blocks,
        "reasons": list(d.reasons),
    }
    if d.first_divergence is not None:
        lo = max(d.first_divergence - CONTEXT_TOKENS, 0)
        out["context"] = {
            "start": lo,
            "a": list(a[lo:d.a_span[1] + CONTEXT_TOKENS]),
            "b": list(b[lo:d.b_span[1] + CONTEXT_TOKENS]),
        }
        if decode is not None:
            out["context"]["a_differs"] = _span_text(a, d.a_span, decode)
            out["context"]["b_differs"] = _span_text(b, d.b_span, decode)
    return out


def _context_line(tokens: Sequence[int], span: tuple[int, int], decode) -> Text:
    lo, hi = max(span[0] - CONTEXT_TOKENS, 0), min(span[1] + CONTEXT_TOKENS, len(tokens))
    pieces = [(tokens[lo:span[0]], ""), (tokens[span[0]:span[1]], "bold red reverse"), (tokens[span[1]:hi], "")]
    line = Text("…" if lo else "")
    for toks, style in pieces:
        shown = decode(list(toks)) if decode else " ".join(map(str, toks)) + " "
        line.append(repr(shown)[1:-1] if decode else shown, style=style)
    line.append("…" if hi < len(tokens) else "")
    return line


def diff_view(d: PromptDiff, a: Sequence[int], b: Sequence[int], model: str, console: Console, decode=None) -> None:
    dec = d.decision
    t = Table(title=f"prompt diff ({model})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("lengths", f"A {d.len_a:,} tokens ({d.cached_blocks_a} full blocks), B {d.len_b:,} ({d.blocks_b})")
    t.add_row("first divergence", "identical" if d.first_divergence is None else f"token {d.first_divergence:,}")
    if d.first_divergence is not None:
        t.add_row("differing span", f"A [{d.a_span[0]:,}, {d.a_span[1]:,})  B [{d.b_span[0]:,}, {d.b_span[1]:,})")
    t.add_row("blocks of B that hit", f"{d.hit_blocks} of {d.blocks_b}")
    t.add_row("tokens reported cached", f"{dec.hit_tokens:,} of {d.len_b:,} ({dec.kind.value})")
    if d.recoverable_blocks:
        t.add_row("won back by moving it", f"{d.recoverable_blocks} more blocks would hit with the differing "
                                           f"span at the end of the prompt")
    for i, r in enumerate(d.reasons):
        t.add_row("why" if i == 0 else "", r)
    console.print(t)
    if d.first_divergence is not None:
        console.print(Text("A: ", style="bold").append(_context_line(a, d.a_span, decode)))
        console.print(Text("B: ", style="bold").append(_context_line(b, d.b_span, decode)))
