"""`kvledger bench vllm`'s schedule and figures, with stand-in engines that answer at once (the bench
itself runs real vLLM processes; here only its bookkeeping is under test): the engines alternate
request by request so both connectors' hits of a round lie side by side, and each figure is the
median the docstring promises."""

from __future__ import annotations

from typing import Any

import json

import pytest

from kvledger.integrations.vllm.bench import load_events, measure


class StandIn:
    """Answers cold prompts in `cold` seconds and repeats in `hit` seconds; logs every request."""

    def __init__(self, name: str, log: list[str], cold: float, hit: float, connector: str | None = "x") -> None:
        self.name, self.log, self.cold, self.hit = name, log, cold, hit
        self.opts = {"connector": connector}
        self.start_s = 1.0
        self.seen: set[tuple[int, ...]] = set()
        self.cpu = 0.0

    def generate(self, prompt: list[int], **_: Any) -> dict[str, Any]:
        key = tuple(prompt)
        repeat = key in self.seen
        self.seen.add(key)
        self.log.append(f"{self.name}{'h' if repeat else 'c'}")
        seconds = self.hit if repeat else self.cold
        self.cpu += seconds / 2
        return {"seconds": seconds, "tokens": [7], "num_cached_tokens": 128 if repeat else 0}

    def cpu_s(self) -> float:
        return self.cpu


def prompt_of(tokens: int, variant: int) -> list[int]:
    return [variant] * tokens


def test_engines_alternate_and_figures_are_round_medians():
    log: list[str] = []
    engines = {"a": StandIn("a", log, cold=100.0, hit=5.0), "b": StandIn("b", log, cold=80.0, hit=6.0)}
    out = measure(engines, tokens=256, rounds=2, hits=3, prompt_of=prompt_of)
    assert log[:2] == ["ac", "bc"]  # warm-ups
    assert log[2:10] == ["ac", "bc", "bh", "ah", "ah", "bh", "bh", "ah"]
    assert log[10:] == ["bc", "ac", "ah", "bh", "bh", "ah", "ah", "bh"]  # the next round starts with b
    assert out["a"]["hit_over_cold"] == 0.05 and out["b"]["hit_over_cold"] == 6.0 / 80.0
    assert out["a"]["ttft_hit_s"] == 5.0 and out["a"]["ttft_hit_cpu_s"] == 2.5
    assert out["a"]["hit_tokens"] == 128 and out["a"]["same_first_token"]
    assert out["a"]["idle_engine_cpu_share"] == 0.0  # a waiting stand-in uses no CPU


def test_an_engine_without_connector_is_only_timed_cold():
    log: list[str] = []
    engines = {"k": StandIn("k", log, 10.0, 1.0), "plain": StandIn("p", log, 10.0, 1.0, connector=None)}
    out = measure(engines, tokens=256, rounds=1, hits=2, prompt_of=prompt_of)
    assert log.count("ph") == 0 and log.count("kh") == 2
    assert "hit_over_cold" not in out["plain"] and out["plain"]["ttft_cold_s"] == 10.0


def test_load_figures_come_from_hits_in_the_event_log(tmp_path):
    lines = [{"event": "save", "ok": 4, "seconds": 9.0}, {"event": "load", "ok": 0, "seconds": 5.0, "waited_s": 5.0},
             {"event": "load", "ok": 31, "seconds": 0.2, "waited_s": 0.01},
             {"event": "load", "ok": 31, "seconds": 0.4, "waited_s": 0.03}]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert load_events(path) == {"load_read_s": pytest.approx(0.3), "load_waited_s": pytest.approx(0.02)}
    assert load_events(tmp_path / "none.jsonl") == {}
