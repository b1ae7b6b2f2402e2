"""Sizes and durations as people type them on a command line: '8G', '500MB', '1.5TiB'; '30s', '5m', '7d'.

Sizes are decimal (K = 1000) unless spelled with 'iB' (KiB = 1024); durations take a unit always
(ms, s, m, h, d), so '30' is never silently seconds where days were meant. Both raise ValueError with
a message that quotes the text; callers add the flag's name.
"""

from __future__ import annotations

import math
import re

SIZE_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_NUMBER_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> float:
    """'8G', '500MB', '1.5TiB', '123' (bytes) or 'inf' → bytes (a float; inf for 'inf', 'unlimited', 'none')."""
    if text.strip().lower() in ("inf", "unlimited", "none"):
        return math.inf
    m = _NUMBER_UNIT.fullmatch(text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise ValueError(f"expected a size such as 8G, 500MB, 1TiB or inf, got {text!r}")
    return float(m.group(1)) * SIZE_UNITS[m.group(2).upper()]


def parse_duration(text: str) -> float:
    """'30s', '1.5m', '2h', '7d', '250ms' → seconds (> 0, finite)."""
    m = _NUMBER_UNIT.fullmatch(text)
    if not m or m.group(2).lower() not in DURATION_UNITS:
        raise ValueError(f"expected a duration with its unit (ms, s, m, h, d) such as 30s or 7d, got {text!r}")
    seconds = float(m.group(1)) * DURATION_UNITS[m.group(2).lower()]
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a duration must be > 0, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Seconds as the largest unit that keeps it short: 259200 → '3d', 90 → '90s', 0.25 → '250ms'."""
    for unit in ("d", "h", "m", "s"):
        n = seconds / DURATION_UNITS[unit]
        if n >= 1 and (n == int(n) or unit == "s"):
            return f"{n:g}{unit}"
    return f"{seconds * 1e3:g}ms"
