"""`kvledger demo`'s chat: replies, cached tokens growing turn by turn, a hit after the restart."""

import re

import pytest


@pytest.mark.slow
def test_demo_chat(run_cli):
    r = run_cli("demo", "--turns", "2", timeout=900)
    assert r.returncode == 0, r.stderr
    cached = [int(m.replace(",", "")) for m in re.findall(r"([\d,]+) of [\d,]+ prompt tokens cached", r.stdout)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0
    m = re.search(r"still hits: ([\d,]+) tokens cached", r.stdout)
    assert m and int(m.group(1).replace(",", "")) > 0
