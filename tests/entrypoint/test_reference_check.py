"""The reference check (issue 19): every greedy reply of a cached server equals a no-cache server's.

A multi-turn chat workload on tiny-v4: shared system prompts, user turns of 10 to 150 tokens, each
next prompt = the previous prompt + its reply + a new user turn, with prompt lengths L chosen so that
L mod 128 covers the residues next to every boundary (0-6 and 122-127, where the cap, the stored
snapshot positions and the decode boundaries meet). Each request is also sent, whole, to one no-cache
engine (`kvledger serve --no-cache`): that is the reference, however the server checked split the request
(prefill and decode legs, other engines, hits). DESIGN rule 10: the answer does not depend on the topology,
and the reference is never split the way the system under test is (a reference that followed the P/D legs
hid 12 wrong replies of 120 through `kvledger up`). tiny-v4 claims bit-exactness (tiny_v4_attention.py),
so 0 mismatches are allowed: any difference is a wrong answer, not rounding.

Rule 9 is what this guards: before it, a fallback's truncated windows were stored as snapshots and
later conversations that resumed from them answered wrongly (4.7% of replies on such a workload).
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from kvledger.store import segment as sg
from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.serve_process import ServeProcess, request, spawn, terminate

B = 128
RESIDUES = [0, 1, 2, 3, 4, 5, 6, 122, 123, 124, 125, 126, 127, 64]


def conversations(seed: int = 7) -> list[list[tuple[int, int]]]:
    """Per conversation, its turns as (user-turn length, reply length): the next prompt length lands on a
    chosen residue mod 128 whenever a user turn of 10-150 tokens can get it there."""
    rng = random.Random(seed)
    out = []
    for c in range(6):
        system = [300, 520, 700][c % 3]
        turns, length = [], system
        for t in range(4):
            reply = rng.randint(6, 20)
            target = RESIDUES[(c * 4 + t) % len(RESIDUES)]
            user = (target - length) % B      # the prompt of this turn: length + user tokens
            user += B if user < 10 else 0     # 10 <= user < 138
            turns.append((user, reply))
            length += user + reply
        out.append(turns)
    return out


def post(url: str, body: dict) -> tuple[int, dict]:
    status, raw = request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


class Node:
    """One kvledger process of a cluster laid out by hand (as on several machines): `up` gives every
    process one data dir, and the dead-mount test gives each machine its own mount of the shared filesystem."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "ab") as out:
            self.proc = spawn([sys.executable, "-m", "kvledger", *args], stdout=out, stderr=subprocess.STDOUT)
        self.url = ""

    def wait_ready(self, timeout_s: float = 600) -> Node:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(r" ready at (http://\S+)", self.log.read_text(errors="replace"))):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-2000:]
            time.sleep(0.2)
        self.url = found.group(1)
        return self


class Reply(NamedTuple):
    length: int          # the prompt's length
    ids: list[int]       # the greedy reply of the server checked
    reference: list[int]  # one no-cache engine's, for the whole request in one request
    usage: dict
    legs: dict           # the checked server's engine legs for it, by (leg kind, hit kind); {} for `serve`


class Reference:
    """The no-cache server's greedy replies, each asked once per module: the tests of this file send the same
    workload, so while their servers answer right they ask the same requests (a wrong reply makes new ones).
    tiny-v4's no-cache reply to a request is one fixed list of floats' argmaxes, so a kept one is the reply."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self.replies: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def complete(self, tokens: list[int], n: int) -> list[int]:
        key = (tuple(tokens), n)
        if key not in self.replies:
            self.replies[key] = complete(self.server, tokens, n)[0]
        return list(self.replies[key])   # a copy: the caller extends it


def run_workload(server: ServeProcess | ClusterProcess | Node, no_cache: Reference,
                 fault: Callable[[], None] | None = None, fault_at: int = 12) -> list[Reply]:
    """Every request of the workload, in order, each with the no-cache server's reply to the same prompt and
    max_tokens, asked in one request whatever legs the server took (rule 10: a P/D decode leg continues the
    request, so tiny-v4's YoCo anchor stays L − 134 of the original prompt, and the reply is the one engine's).
    The legs are kept for the report only. Each next turn extends the server's own reply. `fault` is called
    once, before request `fault_at` (12: halfway; conversations 3-5 share their system prompts with 0-2)."""
    rng = random.Random(11)
    systems = {n: [rng.randrange(3, 32000) for _ in range(n)] for n in (300, 520, 700)}
    results = []
    for c, turns in enumerate(conversations()):
        tokens = list(systems[[300, 520, 700][c % 3]])
        for user, reply in turns:
            if len(results) == fault_at and fault is not None:
                fault()
            tokens += [rng.randrange(3, 32000) for _ in range(user)]
            before = legs(server.url)
            ids, usage = complete(server, tokens, reply)
            taken = {k: n - before.get(k, 0) for k, n in legs(server.url).items() if n > before.get(k, 0)}
            results.append(Reply(len(tokens), ids, no_cache.complete(tokens, reply), usage, taken))
            tokens += ids
    return results


def complete(server: ServeProcess | ClusterProcess, tokens: list[int], n: int) -> tuple[list[int], dict]:
    body = {"model": "tiny-v4", "prompt": tokens, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    status, out = post(server.url + "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["token_ids"], out["usage"]


@pytest.fixture(scope="module")
def no_cache(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("reference") / "data", "--no-cache", model="tiny-v4").start()
    yield Reference(server)
    server.stop()


def test_the_workload_covers_every_residue_near_a_boundary():
    residues = set()
    for c, turns in enumerate(conversations()):
        length = [300, 520, 700][c % 3]
        for user, reply in turns:
            residues.add((length + user) % B)
            length += user + reply
    assert set(RESIDUES) <= residues, sorted(residues)


def assert_as_reference(got: list[Reply], min_snapshot: int | None = None) -> list[str]:
    """0 mismatches, nothing approximate; the hit kinds, for the caller's own checks. At least `min_snapshot`
    (default half) of the replies resumed from a snapshot: the ledgers were used, not bypassed."""
    kinds = [r.usage["kvledger"]["hit_kind"] for r in got]
    assert kinds.count("snapshot") >= (len(got) // 2 if min_snapshot is None else min_snapshot), kinds
    assert "fallback" not in kinds and "replay" not in kinds, kinds   # tiny-v4 resumes exactly (rule 3′)
    wrong = [(i, r.length, r.usage["kvledger"]["hit_kind"], sorted(r.legs)) for i, r in enumerate(got)
             if r.ids != r.reference]
    assert wrong == [], f"{len(wrong)} of {len(got)} replies differ from the no-cache reference: {wrong}"
    return kinds


def test_kvledger_serve_answers_as_the_no_cache_reference(tmp_path, no_cache):
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        got = run_workload(server, no_cache)
    finally:
        server.stop()
    assert_as_reference(got)


def test_kvledger_up_with_prefill_and_decode_legs_answers_as_the_no_cache_reference(tmp_path, no_cache):
    """P/D: the prefill engine computes the first token, the decode engine CHECKs prompt + that token and
    resumes from a snapshot of the prefill engine's (pulled between processes). For L ≡ 5 (mod 128) the
    decode leg's L1 = c + 128 has no snapshot: it resumes exactly from c or p, never falls back."""
    with ClusterProcess(tmp_path / "data", prefill=1, decode=1, model="tiny-v4") as cluster:
        got = run_workload(cluster, no_cache)
        counts = legs(cluster.url)
    assert_as_reference(got)
    # every request ends with a decode leg, or (when the decode engine's heartbeat lapsed on a loaded machine)
    # runs whole on the prefill engine; most decode legs resume from a snapshot, none approximately
    ends = {kind: n for (kind, _), n in counts.items() if kind in ("decode", "whole")}
    decode = {hit: n for (kind, hit), n in counts.items() if kind == "decode"}
    assert sum(ends.values()) == len(got) and decode.get("snapshot", 0) >= len(got) // 2, counts
    assert not {hit for _, hit in counts} & {"fallback", "replay"}, counts   # every leg resumes exactly


def legs(url: str) -> dict[tuple[str, str], float]:
    """The entrypoint's engine legs so far, by (leg kind, hit kind) (`kvledger_engine_legs_total`)."""
    status, raw = request(url + "/metrics")
    assert status == 200
    counts: dict[tuple[str, str], float] = {}
    for line in raw.decode().splitlines():
        if line.startswith("kvledger_engine_legs_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            key = (labels["kind"], labels["hit_kind"])
            counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


# --- the same with a fault injected halfway (conversations 3-5 share their system prompts with 0-2) ---------


def test_a_decode_engine_killed_halfway_costs_no_wrong_answer_and_no_failed_request(tmp_path, no_cache):
    """SIGKILL of the one decode engine between two requests. While its registry entry lives on (the
    heartbeat TTL), a leg sent to it breaks and is continued on the prefill engine; then requests run
    whole there. Every request answers 200 and as the reference."""
    with ClusterProcess(tmp_path / "data", prefill=1, decode=1, model="tiny-v4") as cluster:
        got = run_workload(cluster, no_cache, fault=lambda: cluster.signal("decode-0", signal.SIGKILL))
        counts = legs(cluster.url)
    assert_as_reference(got)
    assert any(line.split()[:1] == ["decode-0"] and "exited with -9" in line for line in cluster.lines)
    # the legs after the kill: one that broke on the dead engine is continued elsewhere; once the registry
    # dropped it, requests run whole on the prefill engine
    assert counts.get(("whole", "snapshot"), 0) >= 1, counts


def flip_a_byte_of_every_block(blocks: Path) -> int:
    """One byte flipped inside each stored block (past the segment's header and metadata); how many."""
    n = 0
    for path in (blocks / "segments").glob("*" + sg.SUFFIX):
        with open(path, "r+b") as f:
            for e in sg.read_meta(f.fileno()).entries:
                f.seek(e[5] + e[3] // 2)
                byte = f.read(1)
                f.seek(e[5] + e[3] // 2)
                f.write(bytes([byte[0] ^ 0x5A]))
                n += 1
    return n


def test_flipped_bytes_in_blocks_another_engine_reads_cost_no_wrong_answer(tmp_path, no_cache):
    """Round-robin over 2 prefill engines: turn t of every conversation runs on prefill-(t % 2), so the second
    turn reads the blocks the first turn's engine wrote. After the first request, one byte of every stored
    block is flipped: prefill-1's reads of them fail their checksum, are misses, and are recomputed."""
    flipped = []
    with ClusterProcess(tmp_path / "data", prefill=2, decode=1, routing="round-robin", model="tiny-v4") as cluster:
        got = run_workload(cluster, no_cache,
                           fault=lambda: flipped.append(flip_a_byte_of_every_block(tmp_path / "data" / "blocks")),
                           fault_at=1)
        corrupt = metric(cluster.url, "kvledger_store_read_misses_total", cause="corrupt")
    assert flipped and flipped[0] > 0
    assert_as_reference(got, min_snapshot=0)
    assert corrupt > 0   # flipped blocks were read, found bad, and recomputed


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` at url/metrics whose labels include `labels`."""
    status, raw = request(url + "/metrics")
    assert status == 200
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_dead_mount_on_one_machine_costs_no_wrong_answer_and_removes_no_block(tmp_path, no_cache, juicefs):
    """A real JuiceFS volume with two clients, as two machines would mount it: prefill-0 on mount 1;
    prefill-1, decode-0 and the entrypoint on mount 2; round-robin over the prefill engines. Halfway,
    mount 1's client is SIGKILLed (every call there fails with ENOTCONN). prefill-0 leaves the registry
    (its health says why), the workload answers as the reference, and no block leaves the shared index:
    a read that fails on one machine proves nothing about the bytes (issue 19 item 3)."""
    import redis

    from kvledger.engine.session import engine_request
    from kvledger.util.cluster_token import new_token_file
    from kvledger.util.redis_server import RedisServer

    with RedisServer() as r:
        mounts = [juicefs.mount(tmp_path / "m1"), juicefs.mount(tmp_path / "m2")]
        token = tmp_path / "cluster.token"
        new_token_file(token)
        common = ["--redis-url", r.url, "--token-file", str(token), "--model", "tiny-v4", "--grace-s", "1"]
        layout = [("prefill-0", "prefill", 0), ("prefill-1", "prefill", 1), ("decode-0", "decode", 1)]
        nodes = [Node(name, ["engine", "--role", role, "--engine-id", name, "--data-dir", str(mounts[m].path),
                             *common], tmp_path / f"{name}.log") for name, role, m in layout]
        nodes.append(Node("entrypoint", ["entrypoint", "--port", "0", "--routing", "round-robin", "--data-dir",
                                         str(mounts[1].path), *common], tmp_path / "entrypoint.log"))
        index = redis.Redis.from_url(r.url)
        published: list[int] = []

        def kill_mount_1() -> None:
            published.append(sum(1 for _ in index.scan_iter(b"kvl:b:*", count=1000)))
            mounts[0].kill()

        try:
            front = [n.wait_ready() for n in nodes][-1]
            deadline = time.monotonic() + 120   # as `up` does: the entrypoint serves once it knows an engine
            while request(front.url + "/health")[0] != 200:
                assert time.monotonic() < deadline, "the entrypoint never saw an engine"
                time.sleep(0.2)
            got = run_workload(front, no_cache, fault=kill_mount_1)
            time.sleep(1.5)   # a heartbeat
            status, raw = engine_request(nodes[0].url, "/engine/v1/health", token.read_text().strip())
            health = json.loads(raw)
            members = {m.decode() for m in index.smembers("kvl:{engines}:set")}
            published.append(sum(1 for _ in index.scan_iter(b"kvl:b:*", count=1000)))
        finally:
            for n in nodes:
                terminate(n.proc, 30)
    assert_as_reference(got, min_snapshot=0)
    assert status == 503 and health["status"] == "unhealthy", health
    assert "Transport endpoint is not connected" in health["fault"], health
    assert "prefill-0" not in members and {"prefill-1", "decode-0"} <= members, members
    assert published[0] > 0 and published[1] >= published[0], published   # nothing unpublished
