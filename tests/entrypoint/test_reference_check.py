"""The reference check (issue 19): every greedy reply of a cached server equals a no-cache server's.

A multi-turn chat workload on tiny-v4: shared system prompts, user turns of 10 to 150 tokens, each
next prompt = the previous prompt + its reply + a new user turn, with prompt lengths L chosen so that
L mod 128 covers the residues next to every boundary (0-6 and 122-127, where the cap, the stored
snapshot positions and the decode boundaries meet). The cached server and the reference run the same
requests in the same order; 0 mismatches are allowed. tiny-v4 computes the same floats however the
positions are split (tiny_v4_attention.py), so a no-cache run of the same request is the exact
reference: any difference is a wrong answer, not rounding.

Rule 9 is what this guards: before it, a fallback's truncated windows were stored as snapshots and
later conversations that resumed from them answered wrongly (4.7% of replies on such a workload).
"""

from __future__ import annotations

import json
import random
import re

import pytest

from kvledger.util.cluster_process import ClusterProcess
from kvledger.util.serve_process import ServeProcess, request

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


def run_workload(server: ServeProcess | ClusterProcess, *, legs: bool = False) -> list[tuple[int, list[int], dict]]:
    """(prompt length, reply token ids, usage) of every request, in order. With `legs`, each reply is asked as
    P/D computes it: its first token from the prompt, the rest from prompt + that token as a new prompt.
    (tiny-v4's YoCo anchor is L − 134 of the prompt a forward starts from, so the split is part of what the
    model computes; tiny_reference in test_cluster.py does the same.)"""
    rng = random.Random(11)
    systems = {n: [rng.randrange(3, 32000) for _ in range(n)] for n in (300, 520, 700)}
    results = []
    for c, turns in enumerate(conversations()):
        tokens = list(systems[[300, 520, 700][c % 3]])
        for user, reply in turns:
            tokens += [rng.randrange(3, 32000) for _ in range(user)]
            ids, usage = complete(server, tokens, 1 if legs else reply)
            if legs:
                ids += complete(server, tokens + ids, reply - 1)[0]
            results.append((len(tokens), ids, usage))
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
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(no_cache):
    return run_workload(no_cache)


@pytest.fixture(scope="module")
def reference_legs(no_cache):
    return run_workload(no_cache, legs=True)


def test_the_workload_covers_every_residue_near_a_boundary(reference):
    residues = {length % B for length, _, _ in reference}
    assert set(RESIDUES) <= residues, sorted(residues)


def assert_as_reference(got: list, reference: list) -> list[str]:
    """0 mismatches, nothing approximate; the hit kinds, for the caller's own checks."""
    kinds = [usage["kvledger"]["hit_kind"] for _, _, usage in got]
    assert kinds.count("snapshot") >= len(got) // 2, kinds   # the ledgers were used, not bypassed
    assert "fallback" not in kinds and "replay" not in kinds, kinds   # tiny-v4 resumes exactly (rule 3′)
    wrong = [(i, length, usage["kvledger"]["hit_kind"]) for i, ((length, ids, usage), (_, ref, _))
             in enumerate(zip(got, reference)) if ids != ref]
    assert wrong == [], f"{len(wrong)} of {len(got)} replies differ from the no-cache reference: {wrong}"
    return kinds


def test_kvledger_serve_answers_as_the_no_cache_reference(tmp_path, reference):
    server = ServeProcess(tmp_path / "data", model="tiny-v4").start()
    try:
        got = run_workload(server)
    finally:
        server.stop()
    assert_as_reference(got, reference)


def test_kvledger_up_with_prefill_and_decode_legs_answers_as_the_no_cache_reference(tmp_path, reference_legs):
    """P/D: the prefill engine computes the first token, the decode engine CHECKs prompt + that token and
    resumes from a snapshot of the prefill engine's (pulled between processes). For L ≡ 5 (mod 128) the
    decode leg's L1 = c + 128 has no snapshot: it resumes exactly from c or p, never falls back."""
    with ClusterProcess(tmp_path / "data", prefill=1, decode=1, model="tiny-v4") as cluster:
        got = run_workload(cluster)
        counts = legs(cluster.url)
    assert_as_reference(got, reference_legs)
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
