"""A holder process for the fault tests: `python tests/state/holder.py --seed S --count N ...`.

Keeps N deterministic snapshots (tests/state/helpers.py) in a slot pool, serves them with a
StateServer on --host, and (with --redis-url) publishes them in a RedisDirectory with
heartbeats. Prints one JSON line {"address", "pool", "keys"} when ready, then reads commands
on stdin, one per line, answering each with one JSON line:
  pull ADDRESS SEED I SIZE   pull (SEED, I) from ADDRESS; answers {"ok", "digest", "cause"}
  exit                       stop cleanly
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvledger.state.client import StateClient  # noqa: E402
from kvledger.state.auth import derive_keys  # noqa: E402
from kvledger.state.directory import Holder, SnapshotEntry, sign  # noqa: E402
from kvledger.state.redis_directory import RedisDirectory  # noqa: E402
from kvledger.state.pool import SlotPool  # noqa: E402
from kvledger.state.pull_server import StateServer  # noqa: E402
from tests.state.helpers import digest, snap_bytes, snap_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--token", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--size", type=int, default=1415040)
    ap.add_argument("--engine-id", default="holder")
    ap.add_argument("--redis-url")
    ap.add_argument("--holder-ttl", type=float, default=1.0)
    ap.add_argument("--max-connections", type=int, default=64)
    args = ap.parse_args()

    pool = SlotPool(args.size, args.count)
    server = StateServer(pool, args.token, args.host, max_connections=args.max_connections).start()
    keys = []
    for i in range(args.count):
        key = snap_key(args.seed, i)
        assert pool.put(key, 128 * (i + 1), snap_bytes(args.seed, i, args.size)).stored
        keys.append(key)
    if args.redis_url:
        import threading

        directory = RedisDirectory(args.redis_url, holder_ttl_s=args.holder_ttl)
        holder = Holder(args.engine_id, server.address)
        dkey = derive_keys(args.token).directory
        directory.publish([sign(dkey, SnapshotEntry(k, holder, 128 * (i + 1), args.size, 0.0))
                           for i, k in enumerate(keys)])
        directory.heartbeat(holder)

        def beat() -> None:
            while True:
                threading.Event().wait(args.holder_ttl / 3)
                directory.heartbeat(holder)

        threading.Thread(target=beat, daemon=True).start()
    print(json.dumps({"address": server.address, "pool": pool.name, "keys": [k.hex() for k in keys]}), flush=True)

    client = StateClient(args.token, timeout_s=5.0)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        assert cmd[0] == "pull"
        address, seed, i, size = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
        before = dict(client.stats)
        data = client.pull(address, snap_key(seed, i))
        cause = [k for k, v in client.stats.items() if v != before.get(k, 0)]
        print(json.dumps({"ok": data is not None and len(data) == size,
                          "digest": digest(data) if data is not None else None, "cause": cause}), flush=True)
    server.stop()
    pool.close()


if __name__ == "__main__":
    main()
