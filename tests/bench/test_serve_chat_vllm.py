"""`kvledger bench serve --against vllm --workload chat`: its input checks, its ratios, and the workload driven
against real `kvledger serve` processes (the vLLM side starts for minutes: docs/results/ keeps its runs)."""

import json
import subprocess
import sys

import pytest

from kvledger.bench.serve_chat_vllm import ChatShape, prompts, ratios

CHAT = [sys.executable, "-m", "kvledger", "bench", "serve", "--against", "vllm", "--workload", "chat",
        "--vllm-python", sys.executable]


@pytest.mark.parametrize("args", [["--chat-concurrency", "0"], ["--chat-concurrency", "two"],
                                  ["--sides", "kvledger,sglang"], ["--chat-turns", "0"]])
def test_bad_input_is_one_line_and_exit_2(args):
    r = subprocess.run([*CHAT, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_every_conversation_shares_the_system_prompt_and_has_its_own_turns():
    shape = ChatShape(sessions=3, max_turns=2, system_tokens=50, user_tokens=7, output_tokens=2, seed=4)
    system, users = prompts(shape, vocab=49_152)
    assert len(system) == 50 and [len(u) for u in users] == [2, 2, 2] and all(len(t) == 7 for u in users for t in u)
    assert len({tuple(t) for u in users for t in u}) == 6
    assert prompts(shape, vocab=49_152) == (system, users)   # seeded: both sides get the same ids


def test_the_ratios_are_kvledger_over_vllm_in_the_same_setting():
    def run(side, burner, c, ttft, rps):
        return {"side": side, "burner": burner, "concurrency": c, "ttft_p50_ms": ttft, "ttft_p90_ms": ttft,
                "inter_token_p50_ms": 10.0, "inter_token_p99_ms": 20.0, "requests_per_s": rps}

    rows = ratios([run("vllm", False, 2, 100.0, 1.0), run("kvledger-equal", False, 2, 50.0, 2.0),
                   run("vllm", True, 2, 200.0, 0.5), run("kvledger-equal", True, 2, 400.0, 0.25),
                   run("kvledger-default", True, 8, 1.0, 1.0)])   # no vLLM run at 8: no ratio
    assert [(r["burner"], r["ttft_p50_ms"], r["requests_per_s"]) for r in rows] == [(False, 0.5, 2.0),
                                                                                     (True, 2.0, 0.5)]


def test_the_workload_runs_against_kvledger_serve_at_both_settings():
    r = subprocess.run([*CHAT, "--model", "smollm2-135m", "--chat-sessions", "3", "--chat-turns", "2",
                        "--system-tokens", "200", "--user-tokens", "20", "--output-tokens", "3",
                        "--chat-concurrency", "2", "--burner", "off", "--sides", "kvledger-equal,kvledger-default",
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [(x["side"], x["requests"]) for x in out["runs"]] == [("kvledger-equal", 6), ("kvledger-default", 6)]
    for x in out["runs"]:
        assert 0 < x["ttft_p50_ms"] <= x["ttft_p90_ms"] and 0 < x["inter_token_p50_ms"] <= x["inter_token_p99_ms"]
        assert x["cached_tokens"] >= 2 * 128   # later turns hit their conversation's earlier ones (and the system)
        assert x["first_turn_ttft_p50_ms"] > 0 and x["first_turn_cached_min"] == 128   # the third: the system prompt
    assert out["ratios"] == []
