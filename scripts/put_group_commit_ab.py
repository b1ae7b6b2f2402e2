"""Puts through one index-writer process (a group commit) against puts that index themselves (the store as it is),
interleaved under the same CPU load: the measurement behind docs/store.md's paragraph on a group commit.

    .venv/bin/python scripts/put_group_commit_ab.py --root /tmp/kvledger-scale/new-10000000 --burners 2.4

`--root` is a store that `kvledger bench scale` built (its default `--dir` holds it). Both sides run the put of
`kvledger bench scale`'s probe (64 blocks of 16 bytes, fsync off) with a second process putting back to back, as
that bench's writer does:

- `direct`: `LmdbStore.put` in each process; the two take turns at LMDB's writer lock.
- `group`: each process dedupes and writes its segment file itself, then sends the segment's index rows over a
  Unix socket to one writer process, which indexes every put waiting in one write transaction and answers each.
  Nothing else in the store changes; this is the part a group commit would move.

The burners run `--warm-s` before the first round; then `--rounds` rounds of `--puts` puts a side, the sides
alternating. Prints each round's p99 and p50 (ms) and the medians over the rounds. A prototype for measuring, not
a mode of the store: the socket carries no token, so it lives in a private temporary folder.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.bench import scale_roles as roles
from kvledger.store import lmdb_write
from kvledger.state.handshake import recv_exact
from kvledger.store.backend import ChainWrite
from kvledger.util.cpu_load import burning

HEAD = struct.Struct("<IQdQ16s")        # rows, start position, TTL (s), file size, parent key
ROW = struct.Struct("<16s16sQQQQ")      # key, parent, position, size, xxh3-64, offset: a segment's entry row
LIVE = struct.Struct("<I")               # the answer: blocks indexed
ANSWER_S = 30.0                          # a put's deadline for the writer's answer
IDLE_S = 3600.0                          # how long the writer waits for a connection's next put
NAMESPACE, TTL_CLASS = roles.NAMESPACE, "agent"


def encode(write: ChainWrite, path: str, rows: list[tuple], file_size: int) -> bytes:
    body = b"".join(ROW.pack(*r) for r in rows)
    text = path.encode()
    return HEAD.pack(len(rows), write.start_pos, write.ttl_s, file_size, write.parent) + struct.pack(
        "<H", len(text)) + text + body


def decode(s: socket.socket) -> tuple[ChainWrite, str, list[tuple], int]:
    deadline = time.monotonic() + IDLE_S
    n, start, ttl_s, file_size, parent = HEAD.unpack(recv_exact(s, HEAD.size, deadline))
    (plen,) = struct.unpack("<H", recv_exact(s, 2, deadline))
    path = recv_exact(s, plen, deadline).decode()
    raw = recv_exact(s, n * ROW.size, deadline)
    rows = [ROW.unpack_from(raw, i * ROW.size) for i in range(n)]
    keys = [r[0] for r in rows]
    return ChainWrite(keys, [b""] * n, start, parent, NAMESPACE, TTL_CLASS, ttl_s), path, rows, file_size


def serve(root: str, sock: str) -> None:
    """The index writer: one thread per connection reads puts; one thread indexes all that wait in one
    transaction, then answers each."""
    store = roles.open_store("new", root, fsync=False)
    pending: queue.Queue[tuple[socket.socket, tuple]] = queue.Queue()

    def index() -> None:
        while True:
            batch = [pending.get()]
            while not pending.empty():
                batch.append(pending.get_nowait())
            now = time.time()
            with store.index.env.begin(write=True) as txn:
                done = [store.writer.index_prepared(txn, lmdb_write.prepare(w, path, rows, size, now), now)
                        for _, (w, path, rows, size) in batch]
            for (conn, _), (live, unlink) in zip(batch, done):
                store.unlink(unlink)
                conn.sendall(LIVE.pack(live))

    def read(conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    pending.put((conn, decode(conn)))
            except (EOFError, TimeoutError):
                pass

    threading.Thread(target=index, daemon=True).start()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock)
    listener.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=read, args=(conn,), daemon=True).start()


class GroupClient:
    """A put as the group commit would make it: dedupe and segment file here, the index rows to the writer."""

    def __init__(self, store: Any, sock: str) -> None:
        self.store = store
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(sock)

    def put(self, write: ChainWrite) -> int:
        st = self.store
        now = st.clock()
        with st.index.env.begin() as txn:
            sel = st._absent(txn, write.keys, now)
        st.index.touched(len(write.keys))
        if not sel:
            return 0
        path, rows, size = st.writer.write_segment(write, sel, [memoryview(write.blocks[i]) for i in sel], now)
        self.sock.sendall(encode(write, path, rows, size))
        return LIVE.unpack(recv_exact(self.sock, LIVE.size, time.monotonic() + ANSWER_S))[0]


def putter(side: str, root: str, sock: str) -> Any:
    store = roles.open_store("new", root, fsync=False)
    return GroupClient(store, sock) if side == "group" else store


def one_put(target: Any, chain: int) -> float:
    keys = roles.synthetic_keys(chain, 0, 64)
    t = time.perf_counter()
    target.put(ChainWrite(keys, [bytes(16)] * len(keys), 0, bytes(16), NAMESPACE, TTL_CLASS, roles.TTL_S))
    return (time.perf_counter() - t) * 1e3


def background(side: str, root: str, sock: str, stop: str) -> None:
    """The second process: puts back to back until `stop` exists."""
    target = putter(side, root, sock)
    base = 8 * 10**9 + os.getpid() * 10**5
    print("ready", flush=True)
    i = 0
    while not os.path.exists(stop):
        one_put(target, base + i)
        i += 1
    print(i, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="example: .venv/bin/python scripts/put_group_commit_ab.py "
                                       "--root /tmp/kvledger-scale/new-10000000 --burners 2.4")
    p.add_argument("--root", required=True, help="a store built by `kvledger bench scale`")
    p.add_argument("--burners", type=float, default=2.4, help="CPU burners, as `kvledger bench scale --burners`")
    p.add_argument("--puts", type=int, default=300, help="puts timed per side and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each timing both sides")
    p.add_argument("--warm-s", type=float, default=60.0, help="seconds the burners run before the first round")
    args = p.parse_args()
    here = Path(tempfile.mkdtemp(prefix="kvledger-group-"))
    sock = str(here / "writer.sock")
    me = [sys.executable, __file__]
    server = subprocess.Popen([*me, "serve", args.root, sock], stdout=subprocess.PIPE, text=True)
    bg: subprocess.Popen | None = None
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "group": []}
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        sides = {side: putter(side, args.root, sock) for side in results}
        with burning(args.burners):
            time.sleep(args.warm_s if args.burners else 0)
            for r in range(args.rounds):
                for k, (side, target) in enumerate(sides.items()):
                    stop = here / f"stop-{r}-{side}"
                    bg = subprocess.Popen([*me, "background", side, args.root, sock, str(stop)],
                                          stdout=subprocess.PIPE, text=True)
                    assert bg.stdout is not None and bg.stdout.readline().strip() == "ready"
                    base = 9 * 10**9 + os.getpid() * 10**5 + (2 * r + k) * args.puts
                    ts = [one_put(target, base + i) for i in range(args.puts)]
                    stop.touch()
                    other = int(bg.communicate(timeout=60)[0].split()[-1])
                    results[side].append((float(np.percentile(ts, 99)), statistics.median(ts)))
                    print(f"round {r} {side:6} p99 {results[side][-1][0]:6.2f} ms  p50 {results[side][-1][1]:5.2f} ms"
                          f"  the other process's puts {other}  load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for proc in (server, bg):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(here, ignore_errors=True)
    for side, rs in results.items():
        print(f"{side:6} p99 median {statistics.median(x[0] for x in rs):6.2f} ms "
              f"({min(x[0] for x in rs):.2f}-{max(x[0] for x in rs):.2f}), "
              f"p50 median {statistics.median(x[1] for x in rs):5.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "background":
        background(*sys.argv[2:6])
    else:
        main()
