"""Many pulling client processes, forked from this small process (cheap, unlike forking pytest):

    python tests/state/clients.py ADDRESS TOKEN SEED SIZE CLIENTS SECONDS

Each child pulls snapshot (SEED, 0) in a loop for SECONDS once all are forked, with a short
pause of its own between pulls, then writes one JSON line {"hits", "wrong", "stats"}; this
process prints the list of them as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvledger.state.client import StateClient  # noqa: E402
from tests.state.helpers import snap_bytes, snap_key  # noqa: E402


def pull_loop(address: str, token: str, seed: int, size: int, seconds: float, go: int, out: int) -> None:
    expected, key = snap_bytes(seed, 0, size), snap_key(seed, 0)
    os.read(go, 1)  # released all at once
    hits = wrong = 0
    with StateClient(token, timeout_s=2.0) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            got = c.pull(address, key)
            if got is not None:
                hits += 1
                wrong += got != expected
            time.sleep(0.002)  # the client's own work: its connection idles meanwhile
        os.write(out, (json.dumps({"hits": hits, "wrong": wrong, "stats": dict(c.stats)}) + "\n").encode())


def main() -> None:
    address, token, seed, size, n, seconds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), float(sys.argv[6])
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                pull_loop(address, token, seed, size, seconds, go_r, out_w)
            finally:
                os._exit(0)
        pids.append(pid)
    os.write(go_w, b"x" * n)
    os.close(out_w)
    with os.fdopen(out_r) as lines:
        results = [json.loads(line) for line in lines]
    for pid in pids:
        os.waitpid(pid, 0)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
