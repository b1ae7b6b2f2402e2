"""How many of kvledger's files one request runs through: a file counts when a function defined in it is called
while the request is served (issue 55's count: kernels and metrics included).

    .venv/bin/python scripts/request_files.py --json

It starts `kvledger serve` (embedded) and `kvledger up --prefill 1 --decode 1` (cluster) with a profiler in every
Python process they start (a `sitecustomize` on PYTHONPATH: `sys.setprofile` and `threading.setprofile`, which
record each kvledger function called, by thread). Per mode: one chat request with a 700-token system prompt is
sent and its blocks left to reach the ledgers (a miss, not counted); every process's record is cleared
(SIGUSR1), the same request is sent again (a hit), `--settle-s` seconds pass for the writes it ends with, and every
process writes its record (SIGUSR2). It prints the files (relative to kvledger/) each mode ran, and those that ran
only on threads that serve no request (`BACKGROUND`: heartbeats, upkeep, scrapes), which are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.serve_process import ServeProcess

PACKAGE = Path(__file__).resolve().parents[1] / "kvledger"
# Threads that run on a timer, whatever the requests: what runs only on them is not the request's.
BACKGROUND = ("heartbeat", "store-stats", "load-sampler", "store-gc", "index-pin")

SITECUSTOMIZE = textwrap.dedent('''
    import json, os, signal, sys, threading
    _OUT = os.environ["KVLEDGER_FILES_OUT"]
    _seen = set()
    def _profile(frame, event, arg):
        if event == "call":
            _seen.add((threading.get_ident(), frame.f_code.co_filename, frame.f_code.co_qualname))
    def _reset(signum, frame):
        _seen.clear()
    def _dump(signum, frame):
        names = {t.ident: t.name for t in threading.enumerate()}
        rows = sorted({(names.get(i, "?"), f, q) for i, f, q in list(_seen) if "/kvledger/" in f})
        with open(os.path.join(_OUT, f"files-{os.getpid()}.json"), "w") as out:
            json.dump({"argv": sys.argv, "rows": rows}, out)
    signal.signal(signal.SIGUSR1, _reset)
    signal.signal(signal.SIGUSR2, _dump)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
''')


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it that runs Python (others, such as redis-server, are left alone)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            if b"python" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            continue
        todo += children.get(p, [])
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def chat(post, system: str) -> dict:
    body = {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]}
    status, out = post("/v1/chat/completions", body)
    assert status == 200, out
    return out["usage"]


def measure(mode: str, root: Path, settle_s: float) -> dict:
    out = root / f"{mode}-records"
    out.mkdir()
    os.environ["KVLEDGER_FILES_OUT"] = str(out)
    system = " ".join(f"Rule {i}: answer plainly and briefly." for i in range(120))   # ~700 tokens
    if mode == "embedded":
        server = ServeProcess(root / "serve").start()
        pid, post, stop = server.proc.pid, server.post, server.stop
    else:
        cluster = ClusterProcess(root / "up", prefill=1, decode=1).start()
        front = ServeProcess(root / "unused")
        front.port = cluster.port
        pid, post, stop = cluster.proc.pid, front.post, cluster.stop
    try:
        first = chat(post, system)
        time.sleep(settle_s)   # the miss's blocks and snapshots reach the ledgers
        pids = descendants(pid)
        signal_all(pids, signal.SIGUSR1)
        time.sleep(0.5)
        usage = chat(post, system)
        time.sleep(settle_s)
        signal_all(pids, signal.SIGUSR2)
        time.sleep(1.0)
    finally:
        stop()
    rows = []
    for f in out.glob("files-*.json"):
        rows += [tuple(r) for r in json.loads(f.read_text())["rows"]]
    on_request = {(f, q) for t, f, q in rows if not any(b in t.lower() for b in BACKGROUND)}
    background = {(f, q) for t, f, q in rows} - on_request
    rel = lambda f: str(Path(f).resolve().relative_to(PACKAGE))   # noqa: E731
    files = sorted({rel(f) for f, _ in on_request})
    return {"mode": mode, "files": len(files), "file_list": files, "processes": len(pids),
            "miss_cached_tokens": first.get("prompt_cache_hit_tokens"), "hit_cached_tokens":
            usage.get("prompt_cache_hit_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
            "background_only": sorted({rel(f) for f, _ in background} - set(files)),
            "functions": sorted(f"{rel(f)}:{q}" for f, q in on_request)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="embedded,cluster", help="embedded, cluster or both (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after each request (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--functions", action="store_true", help="list every function called, too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        results = [measure(m, Path(tmp), args.settle_s) for m in args.modes.split(",")]
    if not args.functions:
        for r in results:
            del r["functions"]
    if args.json:
        print(json.dumps({"results": results}))
        return
    for r in results:
        print(f"{r['mode']}: {r['files']} files ({r['processes']} processes; the hit read {r['hit_cached_tokens']} "
              f"of {r['prompt_tokens']} prompt tokens)")
        for f in r["file_list"]:
            print("   ", f)
        if r["background_only"]:
            print("  not counted (background threads only):", ", ".join(r["background_only"]))


if __name__ == "__main__":
    sys.exit(main())
