"""PNG charts for the benches (matplotlib, Agg backend: no display needed). Small on purpose."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_DPI = 80
_SIZE = (6.0, 3.4)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    _plt().close(fig)


def ttft_cdf(path: Path, series: Mapping[str, Sequence[float]]) -> None:
    """Empirical CDFs of TTFT (s), log x."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=_SIZE)
    for label, values in series.items():
        v = np.sort(np.asarray(values, dtype=float))
        if len(v):
            ax.plot(np.maximum(v, 1e-4), np.arange(1, len(v) + 1) / len(v), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def store_size(path: Path, series: Sequence[tuple[float, int]], capacity: float = math.inf) -> None:
    """Store bytes over simulated time, with the capacity line when finite."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=_SIZE)
    if series:
        t, b = zip(*series)
        ax.plot(np.asarray(t) / 60, np.asarray(b) / 1e9, label="stored")
    if math.isfinite(capacity):
        ax.axhline(capacity / 1e9, color="gray", ls="--", label="capacity")
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("store size (GB)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def _label(row: Mapping[str, Any], cols: Sequence[str]) -> str:
    parts = []
    for c in cols:
        v = row[c]
        if c == "capacity_gb":
            parts.append("∞" if v is None else f"{v:g} GB")
        elif c == "ttl_days":
            parts.append("no TTL" if v is None else f"{v:g} d")
        elif c != "ttl_s":
            parts.append(str(v))
    return "\n".join(parts)


def sweep_chart(path: Path, report: Mapping[str, Any]) -> None:
    """Block hit rate per row (bars) against the reuse ceiling; capacity sweeps as a line."""
    plt = _plt()
    rows, cols = report["rows"], report["columns"]
    with_series = report["sweep"] == "ttl" and all("store_size_over_time" in r for r in rows)
    if with_series:
        fig, (ax, right) = plt.subplots(1, 2, figsize=(9.0, 3.4))
        for r in rows:
            t, b = zip(*r["store_size_over_time"]) if r["store_size_over_time"] else ((), ())
            right.plot(np.asarray(t) / 60, np.asarray(b) / 1e9, label=_label(r, cols))
        right.set_xlabel("simulated time (min)")
        right.set_ylabel("store size (GB)")
        right.grid(alpha=0.3)
        right.legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=_SIZE)
    if report["sweep"] == "capacity":
        finite = [r for r in rows if r["capacity_gb"] is not None]
        ax.plot([r["capacity_gb"] for r in finite], [r["block_hit_rate"] for r in finite], marker="o",
                label="block hit rate")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_plt().FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("store capacity (GB)")
        unlimited = [r for r in rows if r["capacity_gb"] is None]
        if unlimited:
            ax.axhline(unlimited[0]["block_hit_rate"], color="C1", ls=":", label="unlimited")
    elif len(cols) > 1 and cols[1] == "capacity_gb":  # grouped: one bar per capacity within each group
        groups = list(dict.fromkeys(r[cols[0]] for r in rows))
        caps = list(dict.fromkeys(r["capacity_gb"] for r in rows))
        width = 0.8 / len(caps)
        x = np.arange(len(groups))
        for k, cap in enumerate(caps):
            by = {r[cols[0]]: r["block_hit_rate"] for r in rows if r["capacity_gb"] == cap}
            ax.bar(x + (k - (len(caps) - 1) / 2) * width, [by.get(g, 0.0) for g in groups], width,
                   label="unlimited" if cap is None else f"{cap:g} GB", color=f"C{k}")
        ax.set_xticks(x, [str(g) for g in groups], fontsize=8)
    else:
        x = np.arange(len(rows))
        ax.bar(x, [r["block_hit_rate"] for r in rows], color="C0", label="block hit rate")
        ax.set_xticks(x, [_label(r, cols) for r in rows], fontsize=7)
    ax.axhline(report["reuse_ceiling"], color="gray", ls="--", label="reuse ceiling")
    ax.set_ylim(0, 1.15 if report["sweep"] != "capacity" else 1)
    ax.set_ylabel("block hit rate")
    ax.set_title(f"{Path(report['source']).name}: {report['sweep']}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper right" if report["sweep"] != "capacity" else "lower right",
              ncol=3 if report["sweep"] != "capacity" else 1)
    _save(fig, path)


def whatif_chart(path: Path, report: Mapping[str, Any]) -> None:
    """`kvledger whatif`: the predicted token hit rate of each row (bars, one colour per changed setting) beside
    what the live server measured over the window (solid line) and the simulator's figure as recorded (dashed)."""
    plt = _plt()
    rows = report["rows"]
    kinds = list(dict.fromkeys(r["change"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.28 * max(len(rows), 1)))
    y = np.arange(len(rows))[::-1]
    for k, kind in enumerate(kinds):
        idx = [i for i, r in enumerate(rows) if r["change"] == kind]
        ax.barh(y[idx], [rows[i]["token_hit_rate"] for i in idx], color=f"C{k}", label=kind)
    ax.set_yticks(y, [r["setting"] for r in rows], fontsize=7)
    ax.axvline(report["live"]["token_hit_rate"], color="black", label="live (measured)")
    ax.axvline(report["as_recorded"]["token_hit_rate"], color="gray", ls="--", label="as recorded (simulated)")
    ax.set_xlim(0, 1)
    ax.set_xlabel("token hit rate")
    ax.set_title(f"what if: {report['requests']} requests over {report['span_s']:.0f} s", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)
