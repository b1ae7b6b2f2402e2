"""`kvledger bench state`: snapshot pulls against a plain socket send of the same bytes, and
directory lookups embedded and on Redis.

Pulls: one server process per transport on 127.0.0.1, this process pulls. Each round runs
`--pulls` pulls per transport, switching transport every 5 pulls (order alternating), so a
burst of load from elsewhere on the machine hits every transport alike.
  kvledger         StateServer (threads, blocking sockets) serving a snapshot out of a
                   SlotPool slot; StateClient.pull_into: handshake once per connection, then per
                   pull a MACed request, the answer header's MAC and the checksum checked
  plain_socket     a blocking socket server that `sendall`s the same bytes for each 64-byte
                   request; the client `recv_into`s a preallocated buffer; no timeouts,
                   no header, no checksum (the floor)
  plain_scatter    the stricter floor: kvledger's syscall pattern (one sendmsg of a 72-byte
                   header and the bytes; the client's first read scatters into header and
                   buffer) without its work: no token, parsing, pool, checksum or timeouts
  plain_checksum   the floor of a pull that checks its bytes: plain_socket, each piece fed to
                   kvledger's checksum (`pool.running_checksum`) as it lands, the digest compared
  asyncio_streams  (candidate) the same protocol and pool behind asyncio.start_server
                   (StreamWriter.write + drain), pulled by the same StateClient
  zeromq           (candidate) a ROUTER socket sending header + snapshot zero-copy to a
                   DEALER; the client copies the frame into a preallocated buffer
`pull_ratio` = median over rounds of (kvledger throughput / plain throughput) in that round,
`pull_ratio_vs_scatter` and `pull_ratio_vs_checksum` the same against plain_scatter and plain_checksum;
`candidates` the same ratio for the candidates. CPU per pull: the server process's user +
system time over the timed pulls, and this thread's CPU time around its own pulls.

Directory: `--entries` snapshot entries published under one live holder; single-key
lookups per second and batched lookups (`--batch` keys per call) in keys per second,
MemoryDirectory and RedisDirectory interleaved per round with their floor on Redis,
`redis_get` (a plain redis-py GET of one entry, MGET of a batch, same connection, no
liveness check, no decoding); medians reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HELP = "state ledger: snapshot pulls vs a plain socket send of the same bytes; directory lookups"
EXAMPLES = ("kvledger bench state --json --out /tmp/state-bench",)  # `--help`'s epilog
REQUEST_BYTES = 64
BLOCK = 5  # pulls in a row per transport before switching to the next


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.core.spec import PUBLISHED_MODEL

    p.add_argument("--model", default=PUBLISHED_MODEL, help="snapshot size from this model (default %(default)s)")
    p.add_argument("--pulls", type=int, default=100, help="pulls per transport per round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default %(default)s)")
    p.add_argument("--entries", type=int, default=10000, help="directory entries published (default %(default)s)")
    p.add_argument("--lookups", type=int, default=2000,
                   help="single-key lookups per directory per round (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="keys per batched lookup (default %(default)s)")
    p.add_argument("--redis-url", help="Redis to use (default: a private redis-server on a free port)")
    p.add_argument("--no-candidates", action="store_true",
                   help="skip the candidate transports (asyncio streams, ZeroMQ)")
    p.add_argument("--timeout", type=float, default=5.0, help="per-pull timeout in seconds (default %(default)s)")


# --- server processes (spawned) --------------------------------------------------------

def _payload(size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(1234).integers(0, 256, size, dtype=np.uint8).tobytes()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _control(conn: Any) -> None:
    """Answer "cpu" with this process's CPU seconds until told "stop"."""
    while conn.recv() == "cpu":
        conn.send(_cpu_s())


def _kvledger_server(conn: Any, size: int, token: str) -> None:
    from kvledger.state.pool import SlotPool
    from kvledger.state.pull_server import StateServer

    key = bytes(range(16))
    with SlotPool(size, 2) as pool:
        assert pool.put(key, 128, _payload(size)).stored
        server = StateServer(pool, token).start()
        conn.send((server.address, key))
        _control(conn)
        server.stop()


def _asyncio_server(conn: Any, size: int, token: str) -> None:
    """Candidate: the same protocol and pool served by asyncio streams (StreamWriter + drain)."""
    import asyncio

    from kvledger.state import wire as P
    from kvledger.state.pool import SlotPool

    from kvledger.state import auth

    key = bytes(range(16))
    hk = auth.derive_keys(token).handshake

    async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> P.Session | None:
        async with asyncio.timeout(1):
            cn = P.unpack_hello(await reader.readexactly(P.HELLO_BYTES))
            sn = auth.nonce()
            writer.write(P.pack_challenge(sn, auth.server_proof(hk, cn, sn)))
            proof = P.unpack_proof(await reader.readexactly(P.PROOF_BYTES))
        return P.Session(auth.session_key(hk, cn, sn)) if auth.same(proof, auth.client_proof(hk, cn, sn)) else None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.transport.set_write_buffer_limits(high=0)  # drain() == every byte handed to the kernel
        try:
            session, seq = await handshake(reader, writer), 0
            while session is not None:
                async with asyncio.timeout(60):
                    _, got_seq, want = session.read_request(await reader.readexactly(P.REQUEST_BYTES))
                if got_seq != seq:
                    return
                pinned = pool.pin(want)
                if pinned is None:
                    writer.write(session.answer(P.PullStatus.MISS, seq, want))
                    seq += 1
                    continue
                try:
                    writer.write(session.answer(P.PullStatus.OK, seq, want, pinned.size, pinned.position,
                                                pinned.checksum))
                    writer.write(pinned.view)
                    async with asyncio.timeout(5):
                        await writer.drain()
                finally:
                    pool.unpin(want)
                seq += 1
        except (asyncio.IncompleteReadError, OSError, TimeoutError, P.ProtocolError):
            pass
        finally:
            writer.transport.abort()

    def serve(loop: asyncio.AbstractEventLoop, started: Any) -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        started.append(server.sockets[0].getsockname()[1])
        loop.run_forever()

    with SlotPool(size, 2) as pool:
        assert pool.put(key, 128, _payload(size)).stored
        loop, started = asyncio.new_event_loop(), []
        threading.Thread(target=serve, args=(loop, started), daemon=True).start()
        while not started:
            time.sleep(0.01)
        conn.send((f"127.0.0.1:{started[0]}", key))
        _control(conn)
        loop.call_soon_threadsafe(loop.stop)


def _recv_request(c: socket.socket, req: bytearray) -> None:
    """Read one fixed-size request into `req`; ConnectionError when the peer closed."""
    got = 0
    while got < REQUEST_BYTES:
        n = c.recv_into(memoryview(req)[got:])
        if n == 0:
            raise ConnectionError
        got += n


def _serve_plain(conn: Any, answer: Callable[[socket.socket], None]) -> None:
    """A baseline server: blocking, no timeout (kvledger pays for its timeouts); every fixed-size
    request gets `answer(connection)`."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        req = bytearray(REQUEST_BYTES)
        while True:
            c, _ = lsock.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    _recv_request(c, req)
                    answer(c)
            except OSError:
                c.close()

    threading.Thread(target=serve, daemon=True).start()
    conn.send(f"127.0.0.1:{lsock.getsockname()[1]}")
    _control(conn)


def _plain_server(conn: Any, size: int) -> None:
    data = memoryview(_payload(size))
    _serve_plain(conn, lambda c: c.sendall(data))


def _plain_scatter_server(conn: Any, size: int) -> None:
    """The stricter floor: kvledger's syscall pattern (one sendmsg of a 72-byte header and the
    bytes) with none of its work (no token, no parsing, no pool, no timeouts)."""
    from kvledger.state.wire import RESPONSE_BYTES

    data = memoryview(_payload(size))
    head = bytes(RESPONSE_BYTES)

    def answer(c: socket.socket) -> None:
        sent = c.sendmsg([head, data])
        if sent < len(head) + size:
            c.sendall(data[sent - len(head):])

    _serve_plain(conn, answer)


def _zmq_server(conn: Any, size: int) -> None:
    import zmq

    from kvledger.state.wire import RESPONSE_BYTES

    data = memoryview(_payload(size))
    head = bytes(RESPONSE_BYTES)
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        while True:
            ident, _ = s.recv_multipart()
            s.send_multipart([ident, head, data], copy=False)

    threading.Thread(target=serve, daemon=True).start()
    conn.send(f"tcp://127.0.0.1:{port}")
    _control(conn)


class Servers:
    """The bench's server processes, spawned: each sends its address on its pipe, then answers "cpu" with its CPU
    seconds until told "stop" (`_control`)."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self.control: dict[str, Any] = {}  # name -> pipe to its process
        self.pids: dict[str, int] = {}

    def spawn(self, name: str, target: Any, *args: Any) -> Any:
        """Start `target(pipe, *args)` as `name`; what it sends first (its address), within 60 s."""
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        self._procs.append(p)
        self.control[name], self.pids[name] = parent, p.pid
        if not parent.poll(60):
            raise RuntimeError(f"{target.__name__} did not start")
        return parent.recv()

    def cpu(self) -> dict[str, float]:
        """Each process's CPU seconds so far, by name."""
        for c in self.control.values():
            c.send("cpu")
        return {name: c.recv() for name, c in self.control.items()}

    def close(self) -> None:
        for c in self.control.values():
            with contextlib.suppress(OSError):
                c.send("stop")
        for p in self._procs:
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join()


# --- clients ---------------------------------------------------------------------------

def _plain_connection(address: tuple[str, int], timeout: float) -> socket.socket:
    """A connection to a floor's server: TCP_NODELAY as kvledger's, then blocking with no timeout (the floor)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


def _pull_kvledger(client: Any, address: str, key: bytes, buf: bytearray, n: int, timeout: float) -> list[float]:
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        got = client.pull_into(address, key, buf, timeout)
        lat.append(time.perf_counter() - t)
        if got is None:
            raise RuntimeError(f"kvledger pull missed: {dict(client.stats)}")
    return lat


def _pull_plain(sock: socket.socket, buf: bytearray, n: int, checksum: int | None = None) -> list[float]:
    """Plain pulls into `buf`. With `checksum` (plain_checksum), each piece is fed to the pool's running checksum
    as it lands, as `StateClient` does, and the digest compared."""
    from kvledger.state.pool import running_checksum

    req = bytes(REQUEST_BYTES)
    view = memoryview(buf)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        sock.sendall(req)
        digest = None if checksum is None else running_checksum()
        _recv_rest(sock, view, 0, digest)
        if digest is not None and digest.intdigest() != checksum:
            raise RuntimeError("plain_checksum: the bytes do not match their checksum")
        lat.append(time.perf_counter() - t)
    return lat


def _recv_rest(sock: socket.socket, view: memoryview, got: int, digest: Any = None) -> None:
    """Fill `view` from byte `got` on, feeding each piece to `digest` when given; RuntimeError when the baseline
    server closed."""
    while got < view.nbytes:
        k = sock.recv_into(view[got:], view.nbytes - got)
        if k == 0:
            raise RuntimeError("plain server closed the connection")
        if digest is not None:
            digest.update(view[got:got + k])
        got += k


def _pull_scatter(sock: socket.socket, buf: bytearray, n: int) -> list[float]:
    from kvledger.state.wire import RESPONSE_BYTES

    req = bytes(REQUEST_BYTES)
    head = bytearray(RESPONSE_BYTES)
    view = memoryview(buf)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        sock.sendall(req)
        _recv_rest(sock, view, sock.recvmsg_into([head, buf])[0] - len(head))  # header + first bytes in one call
        lat.append(time.perf_counter() - t)
    return lat


def _pull_zmq(sock: Any, buf: bytearray, n: int) -> list[float]:
    req = bytes(REQUEST_BYTES)
    view = memoryview(buf)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        sock.send(req)
        _, frame = sock.recv_multipart(copy=False)
        view[:] = frame.buffer
        lat.append(time.perf_counter() - t)
    return lat


def _summary(lats: list[list[float]], size: int) -> dict[str, float]:
    flat = sorted(x for r in lats for x in r)
    per_round = [size * len(r) / sum(r) for r in lats]
    return {
        "median_ms": round(statistics.median(flat) * 1e3, 4),
        "p99_ms": round(flat[min(len(flat) - 1, int(0.99 * len(flat)))] * 1e3, 4),
        "throughput_gb_s": round(statistics.median(per_round) / 1e9, 4),  # median over rounds, 1e9 B/s
        "pulls": len(flat),
    }


def bench_pulls(size: int, rounds: int, pulls: int, timeout: float, candidates: bool) -> dict[str, Any]:
    """Pull figures per transport; `kvledger` and `plain_socket` always, the candidates on request."""
    from kvledger.state.client import StateClient, parse_address
    from kvledger.state.pool import checksum as pool_checksum

    token = uuid.uuid4().hex
    servers = Servers()
    spawn, server_cpu = servers.spawn, servers.cpu
    clients = [StateClient(token, timeout_s=timeout), StateClient(token, timeout_s=timeout)]
    plain = scatter = checked = zsock = zctx = None
    try:
        buf = bytearray(size)
        kv_address, key = spawn("kvledger", _kvledger_server, size, token)
        plain_address = spawn("plain_socket", _plain_server, size)
        plain = _plain_connection(parse_address(plain_address), timeout)
        scatter_address = spawn("plain_scatter", _plain_scatter_server, size)
        scatter = _plain_connection(parse_address(scatter_address), timeout)
        checked_address = spawn("plain_checksum", _plain_server, size)
        checked = _plain_connection(parse_address(checked_address), timeout)
        expected = _payload(size)
        checksum = pool_checksum(expected)
        runs: dict[str, Any] = {
            "kvledger": lambda n: _pull_kvledger(clients[0], kv_address, key, buf, n, timeout),
            "plain_socket": lambda n: _pull_plain(plain, buf, n),
            "plain_scatter": lambda n: _pull_scatter(scatter, buf, n),
            "plain_checksum": lambda n: _pull_plain(checked, buf, n, checksum),
        }
        if candidates:
            import zmq

            aio_address, aio_key = spawn("asyncio_streams", _asyncio_server, size, token)
            runs["asyncio_streams"] = lambda n: _pull_kvledger(clients[1], aio_address, aio_key, buf, n, timeout)
            zmq_address = spawn("zeromq", _zmq_server, size)
            zctx = zmq.Context()
            zsock = zctx.socket(zmq.DEALER)
            zsock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
            zsock.setsockopt(zmq.LINGER, 0)
            zsock.connect(zmq_address)
            runs["zeromq"] = lambda n: _pull_zmq(zsock, buf, n)

        for name, run in runs.items():  # warm up connections and caches; check the bytes once
            buf[:] = bytes(size)
            run(max(pulls // 10, 3))
            if buf != expected:
                raise RuntimeError(f"{name} delivered wrong bytes")
        lats: dict[str, list[list[float]]] = {name: [] for name in runs}
        client_cpu = dict.fromkeys(runs, 0.0)
        cpu0 = server_cpu()
        order = list(runs)
        for _ in range(rounds):
            this: dict[str, list[float]] = {name: [] for name in runs}
            for b in range(-(-pulls // BLOCK)):  # alternate transports every BLOCK pulls
                n = min(BLOCK, pulls - b * BLOCK)
                for name in order if b % 2 == 0 else order[::-1]:
                    t = time.thread_time()
                    this[name] += runs[name](n)
                    client_cpu[name] += time.thread_time() - t
            for name in runs:
                lats[name].append(this[name])
        cpu1 = server_cpu()
        total = rounds * pulls
        out: dict[str, Any] = {}
        for name, v in lats.items():
            out[name] = _summary(v, size)
            out[name]["server_cpu_us_per_pull"] = round((cpu1[name] - cpu0[name]) / total * 1e6, 1)
            out[name]["client_cpu_us_per_pull"] = round(client_cpu[name] / total * 1e6, 1)

        def ratio(name: str, base: str = "plain_socket") -> list[float]:  # per round: `name` over `base`
            return [sum(p) / sum(k) for k, p in zip(lats[name], lats[base])]

        result: dict[str, Any] = {
            "pull_ratio": round(statistics.median(ratio("kvledger")), 4),
            "pull_ratio_rounds": [round(x, 4) for x in ratio("kvledger")],
            "pull_ratio_vs_scatter": round(statistics.median(ratio("kvledger", "plain_scatter")), 4),
            "pull_ratio_vs_checksum": round(statistics.median(ratio("kvledger", "plain_checksum")), 4),
            "pull": out,
            "client_misses": {k: v for c in clients for k, v in c.stats.items() if k != "hit"},
        }
        if candidates:
            result["candidates"] = {name: round(statistics.median(ratio(name)), 4)
                                    for name in ("asyncio_streams", "zeromq")}
        return result
    finally:
        for c in clients:
            c.close()
        for sock in (plain, scatter, checked):
            if sock is not None:
                sock.close()
        if zsock is not None:
            zsock.close()
            zctx.term()
        servers.close()


# --- directory -------------------------------------------------------------------------

def bench_directory(redis_url: str, entries: int, rounds: int, lookups: int, batch: int) -> dict[str, Any]:
    from kvledger.state.directory import Holder, MemoryDirectory, SnapshotEntry
    from kvledger.state.redis_directory import RedisDirectory

    holder = Holder("bench-holder", "127.0.0.1:1")
    keys = [os.urandom(16) for _ in range(entries)]
    now = time.time()
    published = [SnapshotEntry(k, holder, (i + 1) * 128, 1415040, now) for i, k in enumerate(keys)]
    prefix = f"kvl:bench:{uuid.uuid4().hex[:8]}:"
    dirs = {"embedded": MemoryDirectory(holder_ttl_s=3600), "redis": RedisDirectory(redis_url, prefix=prefix,
                                                                                     holder_ttl_s=3600)}
    try:
        for d in dirs.values():
            for i in range(0, entries, 1000):
                d.publish(published[i:i + 1000])
            d.heartbeat(holder)
            assert all(e is not None for e in d.lookup(keys[:batch])), "published entries must be found"
        rdir = dirs["redis"]
        raw = rdir._r  # the floor: plain GET / MGET of the same keys on the same connection
        names = [rdir._snap(k) for k in keys]
        def one_key(d: Any) -> Any:
            return lambda i: d.lookup([keys[i % entries]])

        def a_batch(d: Any) -> Any:
            return lambda off: d.lookup(keys[off:off + batch])

        lookup_single = {name: one_key(d) for name, d in dirs.items()}
        lookup_batch = {name: a_batch(d) for name, d in dirs.items()}
        lookup_single["redis_get"] = lambda i: raw.get(names[i % entries])
        lookup_batch["redis_get"] = lambda off: raw.mget(names[off:off + batch])
        single: dict[str, list[float]] = {n: [] for n in lookup_single}
        batched: dict[str, list[float]] = {n: [] for n in lookup_single}
        n_batches = max(lookups // 8, 10)
        order = list(lookup_single)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                one, many = lookup_single[name], lookup_batch[name]
                t = time.perf_counter()
                for i in range(lookups):
                    one(i)
                single[name].append(lookups / (time.perf_counter() - t))
                t = time.perf_counter()
                for i in range(n_batches):
                    many((i * batch) % max(entries - batch, 1))
                batched[name].append(n_batches * batch / (time.perf_counter() - t))
        return {name: {"lookups_per_s": round(statistics.median(single[name])),
                       "batched_keys_per_s": round(statistics.median(batched[name])),
                       "batch": batch, "entries": entries} for name in lookup_single}
    finally:
        r = dirs["redis"]
        try:
            names = [r._snap(k) for k in keys] + [r._live(holder.engine_id)]
            for i in range(0, len(names), 1000):
                r._r.delete(*names[i:i + 1000])
        finally:
            for d in dirs.values():
                d.close()


# --- entry -----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> None:
    from kvledger.core import ModelSpec
    from kvledger.util.output import CliError, emit_json

    try:
        spec = ModelSpec.preset(args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    if not spec.has_swa:
        raise CliError(f"{spec.name} has no sliding-window state: nothing to pull")
    for name in ("pulls", "rounds", "entries", "lookups", "batch"):
        if getattr(args, name) <= 0:
            raise CliError(f"--{name} must be > 0")
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    if args.batch > args.entries:
        raise CliError("--batch must be <= --entries")
    size = spec.state_size_to_disk()
    result: dict[str, Any] = {"bench": "state", "model": spec.name, "snapshot_bytes": size,
                              "transport": "threaded blocking sockets", "rounds": args.rounds,
                              "pulls_per_round": args.pulls, "cpus": os.cpu_count()}
    result.update(bench_pulls(size, args.rounds, args.pulls, args.timeout, not args.no_candidates))
    if args.redis_url:
        result["directory"] = bench_directory(args.redis_url, args.entries, args.rounds, args.lookups, args.batch)
        result["redis"] = "given"
    else:
        from kvledger.util.redis_server import RedisServer

        with RedisServer() as r:
            result["directory"] = bench_directory(r.url, args.entries, args.rounds, args.lookups, args.batch)
        result["redis"] = "private redis-server"
    if args.out:
        _write_out(Path(args.out), result)
    if args.json:
        emit_json(result)
    else:
        _table(result)


def _table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"snapshot pulls, {res['snapshot_bytes']:,} B ({res['model']}), "
                    f"{res['rounds']} rounds × {res['pulls_per_round']} pulls")
    for col in ("transport", "median ms", "p99 ms", "GB/s", "vs plain", "server CPU µs/pull"):
        t.add_column(col, justify="right" if col != "transport" else "left")
    plain = res["pull"]["plain_socket"]["throughput_gb_s"]
    for name, s in res["pull"].items():
        ratio = {"kvledger": res["pull_ratio"], "plain_socket": 1.0, **res.get("candidates", {})}.get(name)
        if name == "plain_scatter":
            ratio = res["pull_ratio"] / res["pull_ratio_vs_scatter"]
        t.add_row(name, f"{s['median_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['throughput_gb_s']:.2f}",
                  f"{ratio:.2f}" if ratio is not None else f"{s['throughput_gb_s'] / plain:.2f}",
                  f"{s['server_cpu_us_per_pull']:.0f}")
    d = Table(title="directory lookups")
    for col in ("directory", "lookups/s (1 key)", f"keys/s (batch {res['directory']['embedded']['batch']})"):
        d.add_column(col, justify="right" if col != "directory" else "left")
    for name, s in res["directory"].items():
        d.add_row(name, f"{s['lookups_per_s']:,}", f"{s['batched_keys_per_s']:,}")
    console = Console()
    console.print(t)
    console.print(d)


def _write_out(out: Path, res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "state_bench.json").write_text(json.dumps(res, indent=2) + "\n")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(res["pull"])
    a.bar(names, [res["pull"][n]["throughput_gb_s"] for n in names], color=["C0", "C7", "C8", "C1", "C2"][:len(names)])
    a.tick_params(axis="x", labelrotation=20)
    a.set_ylabel("GB/s (median of rounds)")
    a.set_title(f"pull of {res['snapshot_bytes']:,} B; pull_ratio {res['pull_ratio']:.2f}")
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [res["pull"][n]["median_ms"] for n in names], width=0.4, label="median")
    b.bar([i + 0.2 for i in x], [res["pull"][n]["p99_ms"] for n in names], width=0.4, label="p99")
    b.set_xticks(list(x), names, rotation=20)
    b.set_ylabel("ms per pull")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "state_pulls.png", dpi=120)
    plt.close(fig)
