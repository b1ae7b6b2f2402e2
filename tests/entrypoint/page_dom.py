"""The operator page in headless Chromium: its DOM after the scripts ran, and what it shows."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import pytest

CHROMIUM = shutil.which("chromium")


def chromium(url: str, user_data_dir, *extra: str, budget_ms: int = 8000) -> subprocess.CompletedProcess:
    """Headless Chromium, a fresh profile, no network beyond the page's own server."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={user_data_dir}", f"--virtual-time-budget={budget_ms}", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


class Values(HTMLParser):
    """id → data-value of every element that has both, and the text of each table's body cells."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.body_loaded = False
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self.bars: list[tuple[str, str]] = []   # (cause, tokens) of each bar of the misses chart

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "rect" and "data-cause" in a:
            self.bars.append((a["data-cause"], a["data-tokens"]))
        if tag == "body" and a.get("data-loaded") == "1":
            self.body_loaded = True
        if "id" in a and "data-value" in a:
            self.values[a["id"]] = a["data-value"]
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag == "td":
            self._cell = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None


def page_misses(url: str, profile, key: str | None = None) -> tuple[dict[str, dict[str, int]], list[tuple[str, int]]]:
    """What the operator page shows of the misses: per namespace its miss tokens by cause (the table), and the
    chart's bars (cause, tokens). Skips where chromium is missing."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (make system installs it)")
    run = chromium(url + (f"/#key={key}" if key else "/"), profile, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Values()
    page.feed(run.stdout)
    assert page.body_loaded
    causes = ("cold", "diverged", "expired", "evicted", "load_failed", "snapshot_missing", "tail")
    table = {row[0]: dict(zip(causes, (int(x.replace(",", "")) for x in row[3:])))
             for row in page.tables["miss-causes"][1:] if row}
    return table, sorted((c, int(n)) for c, n in page.bars)
