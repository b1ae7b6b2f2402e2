"""Past the connection cap: many client processes pulling from one holder, none starves."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

CLIENTS = 40
SECONDS = 2.0
SIZE = 64 << 10


def test_many_clients_past_the_cap_all_get_hits(spawn_holder):
    """40 client processes, a holder with 16 connection slots: every client gets hits
    (idle connections make room LRU-first; a BUSY client backs off and retries)."""
    token = uuid.uuid4().hex
    h = spawn_holder(token=token, seed=9, count=1, size=SIZE, max_connections=16, timeout=120)
    script = Path(__file__).with_name("clients.py")
    out = subprocess.run([sys.executable, str(script), h.address, token, "9", str(SIZE), str(CLIENTS), str(SECONDS)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert len(results) == CLIENTS
    hits = sorted(r["hits"] for r in results)
    assert sum(r["wrong"] for r in results) == 0  # never a wrong byte
    assert hits[0] >= 1, hits  # no client starved ...
    misses = sum(v for r in results for k, v in r["stats"].items() if k != "hit")
    assert misses <= 0.05 * sum(hits), [r["stats"] for r in results if len(r["stats"]) > 1]  # ... hardly any missed
    print(f"{CLIENTS} clients, 16 slots: hits per client min {hits[0]} median {hits[len(hits) // 2]}, misses {misses}")
