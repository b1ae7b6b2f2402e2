"""`kvledger bench topology`: multi-turn replies through a topology (P/D legs, one engine, `kvledger serve`), each
against one no-cache engine of the same model asked for the same prompt in one request (DESIGN rule 10).

The workload: `--replies` replies (greedy unless `--temperature`), `--turns` per conversation (the last one may
have fewer). A conversation starts with one of three shared system prompts (300, 520 and 700 random token ids),
so conversations share prefixes; each turn adds a user turn of random token ids whose length puts the prompt's
length L on a chosen residue mod 128 (0-6, 122-127, 64: where the hit cap, the stored snapshot positions and the
decode boundaries meet: tests/entrypoint/test_reference_check.py's design), then the reply (`ignore_eos`: 6-20
tokens); the next turn extends the system under test's own reply. The requests run one at a time, in order.

The system under test (`--topology`), each engine on `--threads` torch threads:

    pd      `kvledger up`: one prefill and one decode engine (its default)
    one     `kvledger up --prefill 0 --decode 0 --both 1`: one engine, the same entrypoint
    serve   `kvledger serve`, its cache on

It runs the whole workload first; then it stops and the reference, `kvledger serve --no-cache` on as many
threads, is asked for every prompt whole. A reply that differs is wrong on a model that claims bit-exactness
(tiny-v4, gemma3-270m); on smollm2-135m, exact only within float rounding, it is a near-tie when the
reference's logits at the first difference hold the two tokens within 2e-4 of max |logit| (near_tie.py), and
wrong otherwise. `--temperature T` samples instead, each request with a seed of its own that the reference
gets too: a later leg must continue the request's draws, not start them again (DESIGN step 8's sampling
state); bit-exact models only, since a sampled token has no logit gap to call a near-tie. The JSON: `wrong`
and `near_ties` (counts) with each one named, the hit kinds counted, and the workload's cached tokens (0: the
cache was never used, and the run checked nothing of it).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.util.output import CliError, emit_json

HELP = "multi-turn replies through P/D, one engine or serve, each against one no-cache engine: wrong, near-ties"
EXAMPLES = ("kvledger bench topology --model tiny-v4 --topology pd --record docs/results",
            "kvledger bench topology --model smollm2-135m --topology one --replies 24 --json")
TOPOLOGIES = ("pd", "one", "serve")
SYSTEM_LENGTHS = (300, 520, 700)   # the shared system prompts; conversation c starts with SYSTEM_LENGTHS[c % 3]
RESIDUES = (0, 1, 2, 3, 4, 5, 6, 122, 123, 124, 125, 126, 127, 64)   # L mod 128 each prompt aims at, in turn
MIN_USER = 10                      # a user turn's least length; it is below MIN_USER + 128
REPLY_TOKENS = (6, 20)             # a reply's max_tokens, uniform
TOKEN_IDS = (3, 32_000)            # user and system tokens: random ids in [3, 32000), in every model's vocabulary
HEAD = 8                           # tokens of a wrong reply shown, from its first difference
TIMEOUT_S = 600.0                  # one request, on a loaded 2-core machine


@dataclass(slots=True)
class Reply:
    """One request of the workload and what came back. Token counts are tokens."""

    conversation: int
    turn: int
    prompt: list[int]
    max_tokens: int
    seed: int | None           # the request's sampling seed (None: greedy)
    got: list[int]             # the system under test's reply
    usage: dict[str, Any]
    want: list[int] | None = None   # the reference's, once asked


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvledger.engine.models.registry import add_model_arg

    add_model_arg(p)
    p.add_argument("--topology", choices=TOPOLOGIES, default="pd", help="the system under test: pd (kvledger up, "
                   "1 prefill + 1 decode engine), one (kvledger up, 1 engine of both roles), serve (kvledger serve)")
    p.add_argument("--replies", type=int, default=120, help="greedy replies in all (default %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine, the reference's included "
                   "(default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled, each request with "
                   "a seed of its own, the reference's the same (bit-exact models only) (default %(default)s)")
    p.add_argument("--seed", type=int, default=11, help="the workload's random seed, and the requests' seeds' base "
                   "(default %(default)s)")
    p.add_argument("--dir", default=None, help="where the servers' data goes (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    from kvledger.bench.near_tie import BIT_EXACT

    if args.model not in BIT_EXACT:
        raise CliError(f"--model {args.model}: one of {', '.join(BIT_EXACT)} (the bench must know whether the model "
                       "claims bit-exactness)")
    if not 1 <= args.replies <= 10_000 or not 1 <= args.turns <= 20 or not 1 <= args.threads <= 64:
        raise CliError("--replies must lie in [1, 10000], --turns in [1, 20] and --threads in [1, 64]")
    if not 0 <= args.temperature <= 10:
        raise CliError(f"--temperature must lie in [0, 10], got {args.temperature}")
    if args.temperature > 0 and not BIT_EXACT[args.model]:
        raise CliError(f"--temperature: {args.model} is exact only within float rounding, and a sampled token that "
                       "differs has no logit gap to call a near-tie: greedy only")
    started = time.monotonic()
    systems, plan = workload(args.replies, args.turns, args.seed)
    with tempfile.TemporaryDirectory(prefix="kvledger-topology-", dir=args.dir) as tmp:
        replies = _through(Path(tmp), args, systems, plan)
        _ask_reference(Path(tmp), args, replies)
    result = _report(args, replies, BIT_EXACT[args.model]) | {"wall_s": round(time.monotonic() - started, 1)}
    if args.json:
        emit_json(result)
    else:
        _print(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "topology.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def workload(replies: int, turns: int, seed: int, block: int = 128
             ) -> tuple[list[list[int]], list[list[tuple[list[int], int]]]]:
    """(the system prompts, per conversation its turns as (user tokens, max_tokens)), `replies` turns in all.
    Turn t of conversation c puts its prompt's length on RESIDUES[(c · turns + t) mod 14] mod `block` whenever a
    user turn of MIN_USER to MIN_USER + 127 tokens can: the previous prompt, its reply and this user turn."""
    rng = random.Random(seed)
    systems = [[rng.randrange(*TOKEN_IDS) for _ in range(n)] for n in SYSTEM_LENGTHS]
    plan: list[list[tuple[list[int], int]]] = []
    for c in range(-(-replies // turns)):
        length, conversation = SYSTEM_LENGTHS[c % len(SYSTEM_LENGTHS)], []
        for t in range(min(turns, replies - c * turns)):
            target = RESIDUES[(c * turns + t) % len(RESIDUES)]
            user = (target - length) % block
            user += block if user < MIN_USER else 0
            reply = rng.randint(*REPLY_TOKENS)
            conversation.append(([rng.randrange(*TOKEN_IDS) for _ in range(user)], reply))
            length += user + reply
        plan.append(conversation)
    return systems, plan


def complete(url: str, model: str, prompt: list[int], max_tokens: int, temperature: float = 0.0,
             seed: int | None = None) -> tuple[list[int], dict[str, Any]]:
    """One /v1/completions request, greedy unless `temperature` > 0: (token ids, usage); RuntimeError when it is
    not answered 200."""
    from kvledger.util.serve_process import request

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True} | ({} if seed is None else {"seed": seed})
    status, raw = request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"},
                          timeout=TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"{url} answered {status} to a {len(prompt)}-token prompt: {raw[:300]!r}")
    out = json.loads(raw)
    return [int(t) for t in out["choices"][0]["token_ids"]], out["usage"]


def _through(tmp: Path, args: argparse.Namespace, systems: list[list[int]],
             plan: list[list[tuple[list[int], int]]]) -> list[Reply]:
    """The workload through the system under test, in order; each next turn extends its own reply."""
    from kvledger.entrypoint.cluster_process import ClusterProcess
    from kvledger.util.serve_process import ServeProcess

    threads = ("--threads", str(args.threads))
    if args.topology == "serve":
        server: ServeProcess | ClusterProcess = ServeProcess(tmp / "serve", *threads, model=args.model)
    else:
        roles = {"pd": (1, 1, 0), "one": (0, 0, 1)}[args.topology]
        server = ClusterProcess(tmp / "up", *threads, prefill=roles[0], decode=roles[1], both=roles[2],
                                model=args.model)
    replies = []
    try:
        server.start()
        for c, conversation in enumerate(plan):
            tokens = list(systems[c % len(systems)])
            for t, (user, max_tokens) in enumerate(conversation):
                tokens += user
                seed = args.seed * 100_000 + len(replies) if args.temperature > 0 else None
                got, usage = complete(server.url, args.model, tokens, max_tokens, args.temperature, seed)
                replies.append(Reply(c, t, list(tokens), max_tokens, seed, got, usage))
                tokens += got
    finally:
        server.stop()
    return replies


def _ask_reference(tmp: Path, args: argparse.Namespace, replies: list[Reply]) -> None:
    """Each reply's prompt, whole, to one `kvledger serve --no-cache` on --threads threads (with its seed)."""
    from kvledger.util.serve_process import ServeProcess

    reference = ServeProcess(tmp / "reference", "--no-cache", "--threads", str(args.threads), model=args.model)
    try:
        reference.start()
        for r in replies:
            r.want = complete(reference.url, args.model, r.prompt, r.max_tokens, args.temperature, r.seed)[0]
    finally:
        reference.stop()


def _report(args: argparse.Namespace, replies: list[Reply], bit_exact: bool) -> dict[str, Any]:
    from kvledger.bench.near_tie import NEAR_TIE_BOUND, ReferenceLogits, classify
    from kvledger.engine.threads import set_threads

    reference: ReferenceLogits | None = None   # the in-process engine, loaded when classify first asks for logits

    def logits_at(r: Reply, j: int) -> Any:
        nonlocal reference
        if reference is None:
            set_threads(args.threads)
            reference = ReferenceLogits(args.model, max(len(x.prompt) + x.max_tokens for x in replies))
        assert r.want is not None
        return reference.at(r.prompt, r.want, j)

    wrong, near_ties = [], []
    for r in replies:
        assert r.want is not None
        verdict = classify(r.got, r.want, bit_exact, functools.partial(logits_at, r))
        if verdict.kind == "equal":
            continue
        if verdict.kind == "near_tie":
            near_ties.append({"conversation": r.conversation, "turn": r.turn, "prompt_tokens": len(r.prompt),
                              "hit_kind": r.usage.get("kvledger", {}).get("hit_kind"),
                              "first_diff": verdict.first_diff, "gap": verdict.gap})
        else:
            wrong.append(_named(r, verdict.first_diff, verdict.gap))
    kinds = Counter(str(r.usage.get("kvledger", {}).get("hit_kind")) for r in replies)
    return {"model": args.model, "topology": args.topology, "bit_exact": bit_exact, "replies": len(replies),
            "turns": args.turns, "threads": args.threads, "seed": args.seed, "temperature": args.temperature,
            "wrong": len(wrong), "near_ties": len(near_ties), "near_tie_bound": None if bit_exact else NEAR_TIE_BOUND,
            "wrong_replies": wrong, "near_tie_replies": near_ties, "hit_kinds": dict(sorted(kinds.items())),
            "cached_tokens": sum(_cached(r.usage) for r in replies),
            "prompt_tokens": sum(len(r.prompt) for r in replies)}


def _named(r: Reply, j: int | None, gap: float | None) -> dict[str, Any]:
    """A wrong reply, named: where it is, how it ran, where it differs and what follows there in each."""
    assert r.want is not None and j is not None
    kv = r.usage.get("kvledger", {})
    legs = [{k: leg.get(k) for k in ("kind", "engine", "start", "cached_tokens", "computed_prompt_tokens")}
            for leg in kv.get("legs") or []]   # usage's legs (cluster mode); [] for `serve`
    return {"conversation": r.conversation, "turn": r.turn, "prompt_tokens": len(r.prompt),
            "hit_kind": kv.get("hit_kind"), "cached_tokens": _cached(r.usage), "legs": legs, "first_diff": j,
            "gap": gap, "got": r.got[j:j + HEAD], "want": r.want[j:j + HEAD]}


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _print(r: dict[str, Any]) -> None:
    print(f"model {r['model']} ({'bit-exact' if r['bit_exact'] else 'exact within float rounding'}), "
          f"topology {r['topology']}, {r['threads']} thread(s) per engine, "
          + (f"sampled at temperature {r['temperature']:g}" if r["temperature"] else "greedy"))
    print(f"replies {r['replies']}")
    print(f"wrong {r['wrong']}")
    print(f"near-ties {r['near_ties']}" + ("" if r["bit_exact"] else f" (gap within {r['near_tie_bound']:g} of "
                                            "max |logit|)"))
    print(f"cached tokens {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens")
    print("hit kinds " + ", ".join(f"{k} {n}" for k, n in r["hit_kinds"].items()))
    for w in r["wrong_replies"]:
        legs = " + ".join(f"{leg['kind']} from {leg['start']} (cached {leg['cached_tokens']})"
                          for leg in w["legs"]) or "-"
        print(f"  wrong: conversation {w['conversation']} turn {w['turn']}, L {w['prompt_tokens']}, hit "
              f"{w['hit_kind']}, legs {legs}, first difference at {w['first_diff']}: got {w['got']} want {w['want']}")
    for t in r["near_tie_replies"]:
        print(f"  near-tie: conversation {t['conversation']} turn {t['turn']}, L {t['prompt_tokens']}, hit "
              f"{t['hit_kind']}, first difference at {t['first_diff']}, gap {t['gap']:.2e} of max |logit|")
    print(f"wall {r['wall_s']} s")
