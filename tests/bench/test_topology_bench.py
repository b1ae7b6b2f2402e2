"""`kvledger bench topology`: the near-tie classification, the workload's residues, the input checks, and a small
real run (tiny-v4 through one engine: every reply as one no-cache engine's, and the cache used)."""

import json
import subprocess
import sys

import pytest
import torch

from kvledger.bench.near_tie import NEAR_TIE_BOUND, classify, first_difference
from kvledger.bench.topology_bench import RESIDUES, SYSTEM_LENGTHS, workload


def logits_with(gap: float, want: int = 3, got: int = 5, vocab: int = 10, top: float = 20.0) -> torch.Tensor:
    """Logits [vocab] whose max |logit| is `top`, with logit[want] − logit[got] = gap · top."""
    x = torch.zeros(vocab)
    x[0] = -top
    x[want], x[got] = 10.0, 10.0 - gap * top
    return x


def test_first_difference_is_where_the_replies_part_or_where_the_shorter_ends():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


@pytest.mark.parametrize(("gap", "kind"), [(0.0, "near_tie"), (NEAR_TIE_BOUND / 2, "near_tie"),
                                           (-NEAR_TIE_BOUND / 2, "near_tie"), (NEAR_TIE_BOUND * 1.5, "wrong"),
                                           (0.05, "wrong")])
def test_a_difference_within_the_bound_of_the_references_logits_is_a_near_tie(gap, kind):
    asked = []

    def logits_at(j: int) -> torch.Tensor:
        asked.append(j)
        return logits_with(gap)

    verdict = classify([7, 5, 1], [7, 3, 1], False, logits_at)
    assert (verdict.kind, verdict.first_diff) == (kind, 1) and asked == [1]
    assert verdict.gap == pytest.approx(gap, abs=1e-7)


def test_on_a_bit_exact_model_any_difference_is_wrong_and_no_logits_are_asked():
    def logits_at(j: int) -> torch.Tensor:
        raise AssertionError("a bit-exact model's difference needs no logits")

    assert classify([7, 5, 1], [7, 3, 1], True, logits_at).kind == "wrong"
    assert classify([7, 3, 1], [7, 3, 1], True, logits_at).kind == "equal"
    assert classify([7, 3], [7, 3, 1], False, logits_at).kind == "wrong"   # cut short: no rounding


def test_the_workload_aims_its_prompts_at_every_residue_next_to_a_boundary():
    systems, plan = workload(120, 4, 11)
    assert [len(s) for s in systems] == list(SYSTEM_LENGTHS) and len(plan) == 30
    assert sum(len(c) for c in plan) == 120 and sum(len(c) for c in workload(10, 4, 11)[1]) == 10
    residues = set()
    for c, turns in enumerate(plan):
        length = SYSTEM_LENGTHS[c % 3]
        for user, reply in turns:
            assert 10 <= len(user) < 138
            residues.add((length + len(user)) % 128)
            length += len(user) + reply
    assert set(RESIDUES) <= residues, sorted(residues)


@pytest.mark.parametrize("args", [["--replies", "0"], ["--topology", "two"], ["--model", "no-such-model"],
                                  ["--threads", "0"], ["--temperature", "-1"],
                                  ["--model", "smollm2-135m", "--temperature", "0.7"]])
def test_bad_input_is_one_line_and_exit_2(args):
    r = subprocess.run([sys.executable, "-m", "kvledger", "bench", "topology", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("temperature", ["0", "0.8"], ids=["greedy", "sampled"])
def test_one_engine_answers_8_replies_as_the_no_cache_engine_and_uses_its_cache(temperature):
    """Sampled: each request's seed reaches the reference too, so one engine's draws are the reference's."""
    r = subprocess.run([sys.executable, "-m", "kvledger", "bench", "topology", "--model", "tiny-v4", "--topology",
                        "one", "--replies", "8", "--temperature", temperature, "--json"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert (out["replies"], out["wrong"], out["near_ties"]) == (8, 0, 0), out["wrong_replies"]
    assert out["cached_tokens"] > 0 and out["hit_kinds"].get("snapshot", 0) >= 4, out


def test_the_reference_logits_are_those_of_the_no_cache_engine(tmp_path):
    """The near-tie's logits come from the forward a no-cache engine runs: at each output index j their argmax is
    the token `kvledger serve --no-cache` answered there (smollm2-135m, a 300-token prompt, 6 tokens)."""
    import random

    from kvledger.bench.near_tie import ReferenceLogits
    from kvledger.bench.topology_bench import complete
    from kvledger.util.serve_process import ServeProcess

    rng = random.Random(3)
    prompt = [rng.randrange(3, 32_000) for _ in range(300)]
    server = ServeProcess(tmp_path / "reference", "--no-cache", "--threads", "1", model="smollm2-135m").start()
    try:
        want = complete(server.url, "smollm2-135m", prompt, 6)[0]
    finally:
        server.stop()
    logits = ReferenceLogits("smollm2-135m", 306)
    assert [int(logits.at(prompt, want, j).argmax()) for j in range(6)] == want
