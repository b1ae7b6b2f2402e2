"""The operator page in headless Chromium: after a few requests, the numbers it shows equal /metrics."""

import json
import re

import pytest

from tests.entrypoint.conftest import OPERATOR, OPS
from tests.entrypoint.metrics_text import metric
from tests.entrypoint.page_dom import CHROMIUM, Values, chromium

MODEL = "smollm2-135m"
PROMPT = "The operator page shows hit rates. " * 30   # > 128 tokens: the second request hits


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make system installs it)")
def test_page_numbers_equal_metrics(open_server, tmp_path):
    for _ in range(2):   # cold, then a hit
        status, body = open_server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                            "temperature": 0})
        assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    run = chromium(open_server.url + f"/#key={OPS}", tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Values()
    page.feed(run.stdout)
    assert page.body_loaded, run.stdout[:2000]
    text = open_server.get("/metrics", OPERATOR)[1].decode()
    prompt = metric(text, "kvledger_prompt_tokens_total")
    hit = metric(text, "kvledger_prompt_cache_hit_tokens_total")
    assert prompt > 0 and hit > 0
    assert float(page.values["prompt-tokens"]) == prompt
    assert float(page.values["hit-tokens"]) == hit
    assert float(page.values["hit-rate"]) == pytest.approx(hit / prompt)
    assert float(page.values["requests"]) == metric(text, "kvledger_requests_total")
    ttft = json.loads(open_server.get("/dashboard/activity", OPERATOR)[1])["ttft_by_length"]["buckets"]
    rows = [row for row in page.tables["ttft"][1:] if row]
    assert len(rows) == len(ttft) >= 1   # one row per prompt-length bucket, cold and hit side by side
    for row, b in zip(rows, ttft):
        assert row[0] == f"{b['tokens_from']:,}–{b['tokens_to']:,}"
        assert (int(row[2]), int(row[4])) == (b["cold"]["requests"], b["hit"]["requests"])
    assert any(int(r[2]) >= 1 for r in rows) and any(int(r[4]) >= 1 for r in rows)
    store = {row[0]: int(row[1].replace(",", "")) for row in page.tables["store-class"][1:] if row}
    assert store and store == {k: int(metric(text, "kvledger_store_blocks", ttl_class=k)) for k in store}
    recent = [row for row in page.tables["recent"][1:] if row]
    assert recent and recent[0][6] in ("full", "snapshot", "fallback", "replay")   # the newest request hit
    assert re.fullmatch(r"[\d,]+", recent[0][4]) and int(recent[0][4].replace(",", "")) > 0


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make system installs it)")
def test_page_renders_offline_screenshot(open_server, tmp_path):
    shot = tmp_path / "page.png"
    run = chromium(open_server.url + f"/#key={OPS}", tmp_path / "profile", f"--screenshot={shot}",
                   "--window-size=1280,1500")
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.stat().st_size > 10_000


def test_diff_form_says_why_a_prompt_missed(open_server):
    """The page's "why did this miss?" form: `kvledger diff` on two prompts, text or token ids."""
    a = "Report generated at 10:21:04. " + "The quarterly numbers follow, one line per shop. " * 40
    status, d = open_server.post("/dashboard/diff", {"a": a, "b": a.replace("10:21:04", "10:25:37")}, OPERATOR)
    assert status == 200, d
    assert d["hit_blocks"] == 0 and 0 < d["first_divergence"] < 128 and d["recoverable_blocks"] > 0
    assert "1:04" in d["context"]["a_differs"] and "5:37" in d["context"]["b_differs"]   # digits are single tokens
    ids = list(range(1000, 1300))
    status, d = open_server.post("/dashboard/diff", {"a": ids, "b": ids[:200] + [7] + ids[201:]}, OPERATOR)
    assert status == 200 and d["first_divergence"] == 200 and d["hit_blocks"] == 1
    status, d = open_server.post("/dashboard/diff", {"a": [1, 2], "b": [10**6]}, OPERATOR)
    assert status == 400 and d["error"]["code"] == "invalid_token_id"
    status, d = open_server.post("/dashboard/diff", {"a": [1], "b": [2]}, {"Authorization": "Bearer sk-nope-00000"})
    assert status == 401   # with a key file, the form needs a key (the page has a field for it)
    status, d = open_server.post("/dashboard/diff", {"a": [1], "b": [2]})   # a tenant's key (alpha)
    assert status == 403 and d["error"]["code"] == "operator_key_required"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make system installs it)")
def test_page_shows_misses_by_cause_and_the_divergence_sites(open_server, tmp_path):
    """The operator page's misses chart and tables equal /v1/cache/misses: a divergence at a timestamp."""
    a = "Report of 10:21:04Z for the shops. " + "The quarterly numbers follow, one line per shop. " * 20
    for prompt in (a, a.replace("10:21:04Z", "10:25:37Z")):
        status, body = open_server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                            "temperature": 0})
        assert status == 200, body
    run = chromium(open_server.url + f"/#key={OPS}", tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    page = Values()
    page.feed(run.stdout)
    assert page.body_loaded
    data = json.loads(open_server.get("/v1/cache/misses", OPERATOR)[1])["data"]
    causes = {row[0]: row for row in page.tables["miss-causes"][1:] if row}
    for t in data:
        row = causes[t["namespace"]]
        assert int(row[1].replace(",", "")) == t["requests"]
        assert [int(x.replace(",", "")) for x in row[3:]] == [t["miss_tokens"].get(c, 0) for c in (
            "cold", "diverged", "expired", "evicted", "load_failed", "snapshot_missing", "tail")]
    sites = [row for row in page.tables["divergences"][1:] if row]
    alpha = next(t for t in data if t["namespace"] == "alpha")
    assert alpha["top_divergences"] and any("5:37" in row[4] and "1:04" in row[5] for row in sites), sites
    bars = sorted((c, int(n)) for c, n in page.bars)
    assert bars == sorted((c, n) for t in data for c, n in t["miss_tokens"].items() if n > 0)
