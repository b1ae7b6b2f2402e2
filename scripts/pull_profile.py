"""Where a state pull's CPU goes, side by side with the checksummed floor: `perf` samples per pull, by process and
by library (the kernel, the Python interpreter, xxHash, OpenSSL, libc).

    .venv/bin/python scripts/pull_profile.py --rounds 5 --pulls 400

`kvledger bench state` times a pull against plain sockets; this says what the difference is made of. Each round
profiles `--pulls` pulls of one transport with `perf record -e cpu-clock` attached to the puller (this process)
and its server, then the same for the other transport, alternating which goes first. The transports are those of
the bench: `kvledger` (StateClient.pull_into from a StateServer serving a SlotPool slot) and `plain_checksum` (a
blocking socket that `sendall`s the same bytes, the puller feeding each piece to the same running xxh3 checksum).
It prints, per side and library, the median over rounds of the CPU µs per pull (samples / frequency / pulls), and
beside it each side's CPU per pull from the OS, which the samples should match. Needs `perf` (Debian:
linux-perf) with perf_event_paranoid <= 2 for one's own processes.

`--block N` profiles the bench's own pattern instead: within a round the two transports take turns every N pulls
(the bench takes 5, in the order A B B A A B ...), under one `perf record` of the puller and both servers. Each
transport pulls from its own thread of the puller, waiting for its turn, so the puller's samples split by thread.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvledger.bench import record
from kvledger.bench import state_bench as sb
from kvledger.core import ModelSpec
from kvledger.core.spec import PUBLISHED_MODEL
from kvledger.state.client import StateClient, parse_address
from kvledger.state.pool import checksum as pool_checksum

LIBRARIES = {"[kernel.kallsyms]": "kernel", "libpython": "python", "_xxhash": "xxhash", "libcrypto": "openssl",
             "libc.so": "libc"}   # a dso name containing the key → its row; anything else is "other"
TRANSPORTS = ("kvledger", "plain_checksum")


def library(dso: str) -> str:
    return next((row for part, row in LIBRARIES.items() if part in dso), "other")


def threads(pids: dict[int, str]) -> dict[int, str]:
    """Each live thread of the processes `pids` → that process's side (perf's `pid` column is a thread id)."""
    return {int(tid): side for pid, side in pids.items() for tid in os.listdir(f"/proc/{pid}/task")}


def samples_by_side(data: Path, tids: dict[int, str]) -> dict[str, collections.Counter]:
    """perf's samples in `data`, summed per side ("client" / "server") and library; `tids` as from `threads`."""
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "-g", "none",
                             "--sort", "pid,dso", "-F", "sample,pid,dso", "--field-separator", "\t"],
                            capture_output=True, text=True, check=True).stdout
    out: dict[str, collections.Counter] = {side: collections.Counter() for side in tids.values()}
    for line in report.splitlines():
        if not line or line.startswith("#"):
            continue
        n, pid_comm, dso = (part.strip() for part in line.split("\t"))
        side = tids.get(int(pid_comm.split(":", 1)[0]))
        if side is not None:
            out[side][library(dso)] += int(n)
    return out


def profile_one(run: Any, server_pid: int, control: Any, pulls: int, freq: int, folder: Path) -> dict[str, Any]:
    """One transport's `pulls` under perf: µs per pull by side and library, and the OS's CPU per pull."""
    data = folder / "perf.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(freq), "-p",
                             f"{os.getpid()},{server_pid}", "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)   # perf attaches (to the threads there are: the server's connection thread is one)
        control.send("cpu")
        server0, client0, t0 = control.recv(), time.thread_time(), time.perf_counter()
        lat = run(pulls)
        wall, client1 = time.perf_counter() - t0, time.thread_time()
        control.send("cpu")
        server1 = control.recv()
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(30)
    per_pull = 1e6 / freq / pulls
    tids = threads({os.getpid(): "client", server_pid: "server"})   # the server's connection thread is still up
    sides = samples_by_side(data, tids)
    return {
        "median_pull_us": statistics.median(lat) * 1e6,
        "wall_us": wall * 1e6 / pulls,
        "cpu_us": {"client": (client1 - client0) * 1e6 / pulls, "server": (server1 - server0) * 1e6 / pulls},
        "sampled_us": {side: {lib: n * per_pull for lib, n in c.items()} for side, c in sides.items()},
    }


def profile_interleaved(runs: dict[str, Any], pids: dict[str, int], controls: dict[str, Any], pulls: int,
                        block: int, freq: int, folder: Path) -> dict[str, dict[str, Any]]:
    """`pulls` of each transport taking turns every `block` pulls, as `kvledger bench state` does, under one perf
    record: per transport, the same figures as `profile_one`. Each transport pulls from its own thread."""
    names = list(runs)
    schedule = [name for b in range(-(-pulls // block)) for name in (names if b % 2 == 0 else names[::-1])]
    turn, lock = [0], threading.Condition()
    ready = threading.Barrier(len(names) + 1)
    got: dict[str, dict[str, Any]] = {}

    failed: list[BaseException] = []

    def puller(name: str) -> None:
        lat: list[float] = []
        tid = threading.get_native_id()
        ready.wait()   # perf is attached
        cpu0 = time.thread_time()
        try:
            for i, who in enumerate(schedule):
                if who != name:
                    continue
                with lock:
                    lock.wait_for(lambda i=i: turn[0] == i or failed)
                if failed:
                    return
                lat += runs[name](min(block, pulls - block * (i // len(names))))
                with lock:
                    turn[0] += 1
                    lock.notify_all()
        except BaseException as e:   # a missed pull: the other puller stops waiting for its turn
            with lock:
                failed.append(e)
                lock.notify_all()
            return
        got[name] = {"lat": lat, "cpu": time.thread_time() - cpu0, "tid": tid}

    workers = [threading.Thread(target=puller, args=(name,), daemon=True) for name in names]
    for w in workers:
        w.start()
    data = folder / "perf.data"
    time.sleep(0.2)   # the pullers exist, so perf attaches to them
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(freq), "-p",
                             ",".join(str(pid) for pid in (os.getpid(), *pids.values())), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        for c in controls.values():
            c.send("cpu")
        server0 = {name: controls[name].recv() for name in names}
        ready.wait()
        for w in workers:
            w.join()
        if failed:
            raise failed[0]
        for c in controls.values():
            c.send("cpu")
        server1 = {name: controls[name].recv() for name in names}
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(30)
    labels = {got[name]["tid"]: f"{name}/client" for name in names}
    for name in names:
        labels |= {tid: f"{name}/server" for tid in threads({pids[name]: "server"})}
    samples = samples_by_side(data, labels)
    per_pull = 1e6 / freq / pulls
    return {name: {
        "median_pull_us": statistics.median(got[name]["lat"]) * 1e6,
        "cpu_us": {"client": got[name]["cpu"] * 1e6 / pulls, "server": (server1[name] - server0[name]) * 1e6 / pulls},
        "sampled_us": {side: {lib: n * per_pull for lib, n in samples[f"{name}/{side}"].items()}
                       for side in ("client", "server")},
    } for name in names}


def profile(rounds: int, pulls: int, freq: int, size: int, block: int = 0) -> dict[str, Any]:
    token = uuid.uuid4().hex
    servers = sb.Servers()
    spawn, controls, pids = servers.spawn, servers.control, servers.pids
    client = StateClient(token)
    plain = None
    try:
        buf = bytearray(size)
        kv_address, key = spawn("kvledger", sb._kvledger_server, size, token)
        plain = sb._plain_connection(parse_address(spawn("plain_checksum", sb._plain_server, size)), 5.0)
        expected = sb._payload(size)
        checksum = pool_checksum(expected)
        runs = {"kvledger": lambda n: sb._pull_kvledger(client, kv_address, key, buf, n, 5.0),
                "plain_checksum": lambda n: sb._pull_plain(plain, buf, n, checksum)}
        for name, run in runs.items():
            buf[:] = bytes(size)
            run(100)   # warm up; and the bytes are right
            if buf != expected:
                raise RuntimeError(f"{name} delivered wrong bytes")
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
        with tempfile.TemporaryDirectory(prefix="kvledger-pull-profile-") as tmp:
            for r in range(rounds):
                if block:
                    order = list(TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1])
                    one = profile_interleaved({name: runs[name] for name in order}, pids, controls, pulls, block,
                                              freq, Path(tmp))
                    for name in TRANSPORTS:
                        got[name].append(one[name])
                    continue
                for name in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                    got[name].append(profile_one(runs[name], pids[name], controls[name], pulls, freq, Path(tmp)))
        return {"size": size, "rounds": rounds, "pulls": pulls, "block": block, "freq_hz": freq,
                "load_1m": os.getloadavg()[0], "transports": {name: summarise(rs) for name, rs in got.items()}}
    finally:
        client.close()
        if plain is not None:
            plain.close()
        servers.close()


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds (a library a round did not sample counts as 0 in it)."""
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 1)

    out: dict[str, Any] = {"median_pull_us": med([r["median_pull_us"] for r in rounds]),
                           "cpu_us": {}, "sampled_us": {}}
    for side in ("client", "server"):
        out["cpu_us"][side] = med([r["cpu_us"][side] for r in rounds])
        libs = sorted({lib for r in rounds for lib in r["sampled_us"][side]})
        out["sampled_us"][side] = {lib: med([r["sampled_us"][side].get(lib, 0.0) for r in rounds]) for lib in libs}
    return out


def table(res: dict[str, Any]) -> None:
    kv, floor = res["transports"]["kvledger"], res["transports"]["plain_checksum"]
    pattern = f", the two taking turns every {res['block']}" if res.get("block") else ""
    print(f"µs per pull of {res['size']:,} B, median of {res['rounds']} rounds of {res['pulls']} pulls{pattern} "
          f"(perf cpu-clock at {res['freq_hz']} Hz; load {res['load_1m']:.2f})")
    print(f"{'':18s} {'kvledger':>10s} {'plain_checksum':>15s} {'difference':>11s}")
    print(f"{'median pull':18s} {kv['median_pull_us']:10.1f} {floor['median_pull_us']:15.1f} "
          f"{kv['median_pull_us'] - floor['median_pull_us']:11.1f}")
    for side in ("client", "server"):
        print(f"{side + ' CPU (OS)':18s} {kv['cpu_us'][side]:10.1f} {floor['cpu_us'][side]:15.1f} "
              f"{kv['cpu_us'][side] - floor['cpu_us'][side]:11.1f}")
        libs = sorted(set(kv["sampled_us"][side]) | set(floor["sampled_us"][side]),
                      key=lambda lib: -kv["sampled_us"][side].get(lib, 0.0))
        for lib in libs:
            a, b = kv["sampled_us"][side].get(lib, 0.0), floor["sampled_us"][side].get(lib, 0.0)
            print(f"{'  ' + side + ' ' + lib:18s} {a:10.1f} {b:15.1f} {a - b:11.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python scripts/pull_profile.py --rounds 5 --pulls 400 --json",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=PUBLISHED_MODEL, help="snapshot size from this model")
    p.add_argument("--rounds", type=int, default=5, help="profiled rounds per transport, interleaved")
    p.add_argument("--pulls", type=int, default=400, help="pulls per profiled round")
    p.add_argument("--freq", type=int, default=4999, help="perf's sampling frequency, Hz")
    p.add_argument("--block", type=int, default=0, help="take turns every N pulls, as the bench does (5); 0: each "
                                                        "transport's pulls of a round in one run")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.add_argument("--record", metavar="DIR", help="also write the JSON, with where and when it ran, to "
                                                   "DIR/pull-profile-<UTC time>.json (docs/results)")
    args = p.parse_args()
    if min(args.rounds, args.pulls, args.freq) < 1 or args.block < 0:
        p.error("--rounds, --pulls and --freq must be >= 1, --block >= 0")
    if shutil.which("perf") is None:
        print("pull_profile: `perf` is not installed (Debian: apt-get install linux-perf)", file=sys.stderr)
        raise SystemExit(2)
    try:
        spec = ModelSpec.preset(args.model)
    except ValueError as e:
        p.error(f"--model: {e}")
    if not spec.has_swa:
        p.error(f"--model: {spec.name} has no sliding-window state: nothing to pull")
    size = spec.state_size_to_disk()
    before, started, commit = os.getloadavg(), time.time(), record.checkout_commit()
    try:
        res = profile(args.rounds, args.pulls, args.freq, size, args.block)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    if args.record:
        res["run"] = record.run_info("pull-profile", before, started, commit)
        res["run"]["command"] = "python scripts/pull_profile.py " + " ".join(sys.argv[1:])
        folder = Path(args.record)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
        (folder / f"pull-profile-{stamp}.json").write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        table(res)


if __name__ == "__main__":
    main()
