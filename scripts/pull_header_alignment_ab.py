"""Does the size of the header in front of a snapshot change a loopback pull? Interleaved A/B, plain sockets.

    .venv/bin/python scripts/pull_header_alignment_ab.py --heads 72,64,128 --pulls 3000

docs/state.md names a frame whose payload starts at a cache-line offset as one way to close the gap to a plain
socket: kvledger's answer head is 72 bytes, so the payload lands 8 bytes off a 64-byte line in the receiver's
socket buffer. This measures that alone, without kvledger's protocol: a server process answers each 64-byte
request with one `sendmsg` of a zero head of the asked size and a 1,415,040-byte payload (one DeepSeek-V4
snapshot) from anonymous shared memory; the client reads them with `StateClient`'s own calls on a non-blocking
socket (one scatter read, then the rest into place; no MAC, no checksum). Head sizes alternate in blocks of 20
pulls; prints each size's median and p10 pull (µs) over the pulls after the first tenth.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import socket
import statistics
import time

from kvledger.state.handshake import after_handshake
from kvledger.state.sockio import recv_fill, recvmsg_some, send_all

PAYLOAD = 1_415_040   # bytes: 20 layers x 134 tokens x 528 B
BLOCK = 20            # pulls in a row at one head size
TIMEOUT_S = 30.0      # each pull's deadline


def serve(conn: socket.socket, payload: memoryview) -> None:
    heads: dict[int, bytes] = {}
    while request := conn.recv(64):
        size = int.from_bytes(request[:2], "little")
        conn.sendmsg([heads.setdefault(size, bytes(size)), payload])


def pull(conn: socket.socket, head: bytearray, body: memoryview) -> None:
    """One pull as `StateClient._exchange` reads it: a scatter read of head and payload, then the rest in place."""
    deadline = time.monotonic() + TIMEOUT_S
    send_all(conn, [len(head).to_bytes(2, "little") + bytes(62)], deadline)
    got = recvmsg_some(conn, [head, body], deadline)
    if got < len(head):
        got += recv_fill(conn, memoryview(head)[got:], deadline)
    recv_fill(conn, body[got - len(head):], deadline)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python scripts/pull_header_alignment_ab.py --heads 72,64,128",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", default="72,64,128", help="head sizes in bytes, comma-separated")
    p.add_argument("--pulls", type=int, default=3000, help="pulls in all, the sizes taking turns")
    args = p.parse_args()
    try:
        sizes = [int(h) for h in args.heads.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 0 < h < 65536 for h in sizes) or args.pulls < BLOCK * len(sizes):
        p.error(f"--heads: sizes in 1..65535; --pulls at least {BLOCK} per size")
    shm = mmap.mmap(-1, PAYLOAD)
    shm[:] = os.urandom(PAYLOAD)
    listener = socket.create_server(("127.0.0.1", 0))
    server = os.fork()
    if server == 0:
        conn = listener.accept()[0]
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        serve(conn, memoryview(shm))
        os._exit(0)
    try:
        with socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            after_handshake(conn)
            body = memoryview(bytearray(PAYLOAD))
            times: dict[int, list[float]] = {h: [] for h in sizes}
            for i in range(args.pulls):
                size = sizes[(i // BLOCK) % len(sizes)]
                t = time.perf_counter_ns()
                pull(conn, bytearray(size), body)
                times[size].append((time.perf_counter_ns() - t) / 1e3)
                assert body[-1] == shm[PAYLOAD - 1]
    finally:   # the server ends at the client's EOF; stopped here too, should the client end before connecting
        os.kill(server, signal.SIGTERM)
        os.waitpid(server, 0)
    for size, ts in times.items():
        kept = sorted(ts[len(ts) // 10:])
        print(f"head {size:>5} B: median {statistics.median(kept):6.0f} µs, p10 {kept[len(kept) // 10]:6.0f} µs "
              f"({len(kept)} pulls)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:   # Ctrl-C: the server child is stopped in main's finally
        raise SystemExit(130) from None
