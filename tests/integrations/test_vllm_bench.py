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


# --- `kvledger bench vllm --model gemma3-270m`: its schedule and report, with stand-ins (no vLLM) ---

from kvledger.integrations.vllm import hybrid_report, hybrid_schedule  # noqa: E402
from kvledger.integrations.vllm.hybrid_bench import all_layers_bytes_per_token  # noqa: E402
from kvledger.integrations.vllm.peers import bytes_under, failure_line  # noqa: E402


class Hybrid:
    """A stand-in vLLM: cold the first time it sees (prompt, salt) unless `store` already has it (a
    connector's store shared by processes), a hit after; answers `answer` × max_tokens; logs every call."""

    def __init__(self, name: str, log: list[str], cold: float, hit: float, store: set | None = None,
                 answer: int = 7, cache: bool = True) -> None:
        self.name, self.log, self.cold, self.hit, self.answer = name, log, cold, hit, answer
        self.store = set() if store is None else store
        self.cache = cache   # False: a hit needs the store (kvledger, Mooncake with vLLM's own cache off)
        self.cpu = 0.0

    def generate(self, prompt: list[int], *, max_tokens: int = 1, salt: str | None = None, **_: Any) -> dict:
        key = (tuple(prompt), salt)
        repeat = key in self.store
        self.store.add(key)
        kind = {(False, None): "c", (True, None): "h"}.get((repeat, salt), "s")
        self.log.append(f"{self.name}{kind}{max_tokens}")
        seconds = self.hit if repeat else self.cold
        self.cpu += seconds
        return {"seconds": seconds, "tokens": [self.answer] * max_tokens,
                "num_cached_tokens": (len(prompt) - 1) // 128 * 128 if repeat else 0}

    def cpu_s(self) -> float:
        return self.cpu

    def reset_prefix_cache(self) -> bool:
        self.log.append(f"{self.name}reset")
        return True


def test_stored_phase_colds_all_then_same_process_hits_and_one_greedy_check_per_size():
    log: list[str] = []
    engines = {"vllm": Hybrid("v", log, 10.0, 0.5), "kvledger": Hybrid("k", log, 11.0, 1.0),
               "simple_cpu_offload_disk": Hybrid("s", log, 12.0, 2.0)}
    seen: list[int] = []
    samples = hybrid_schedule.stored_phase(engines, [256, 512], 2, prompt_of, after_size=seen.append)
    assert seen == [256, 512]
    # size 256, r = 0: every role cold; the same-process roles hit (SimpleCPUOffload after vLLM's own cache
    # is emptied); the check: their 16-token hits, then vLLM computes the prompt cold under another salt
    assert log[:9] == ["vc1", "kc1", "sc1", "vh1", "sreset", "sh1", "vh16", "sreset", "sh16"]
    assert log[9] == "vs16"
    assert log[10:15] == ["kc1", "sc1", "vc1", "sreset", "sh1"]   # r = 1: the order rotated by one, no check
    assert log[15] == "vh1"
    assert {s["kind"] for s in samples if s["role"] == "kvledger"} == {"cold"}
    assert len({tuple(prompt_of(t, hybrid_schedule.variant(t, r))) for t in (256, 512) for r in (0, 1)}) == 4


def test_warm_up_asks_each_engine_a_short_prompt_twice_a_cold_then_a_hit():
    log: list[str] = []
    engines = {"vllm": Hybrid("v", log, 10.0, 0.5), "kvledger": Hybrid("k", log, 11.0, 1.0)}
    hybrid_schedule.warm_up(engines, prompt_of, 10_000)
    assert log == ["vc1", "vh1", "kc1", "kh1"]


def test_fresh_phase_hits_every_stored_prompt_and_checks_16_tokens_at_the_first_repeat():
    log: list[str] = []
    store: set = set()
    first = {"kvledger": Hybrid("k", log, 11.0, 1.0, store, cache=False)}
    hybrid_schedule.stored_phase(first, [256], 2, prompt_of)
    fresh = {"vllm": Hybrid("V", log, 11.0, 0.5), "kvledger": Hybrid("K", log, 11.0, 1.0, store, cache=False),
             "mooncake": Hybrid("M", log, 11.0, 1.0, store, cache=False)}
    samples = hybrid_schedule.fresh_phase(fresh, [256], 2, prompt_of)
    # vLLM alone hits its own cache beside the fresh processes; only the fresh ones take the greedy check
    # (each prompt first refilled in vLLM's cache, not counted: its LRU may have evicted it)
    assert log[2:] == ["Vc1", "Vh1", "Kh1", "Mh1", "Kh16", "Mh16", "Vc1", "Kh1", "Mh1", "Vh1"]
    hits = [s for s in samples if s["kind"] != "refill"]
    assert all(s["cached"] == 128 and s["phase"] == "fresh" for s in hits) and len(hits) == 8


def sample(role: str, kind: str, seconds: float, repeat: int = 0, tokens: int = 4096, cached: int = 0,
           answer: list[int] | None = None) -> dict:
    return {"role": role, "prompt_tokens": tokens, "repeat": repeat, "kind": kind, "seconds": seconds,
            "cpu_s": seconds / 2, "cached": cached, "tokens": answer or [7]}


def test_report_gives_medians_spreads_and_each_repeats_hit_over_vllms_own_hit():
    samples = [sample("vllm", "cold", c, r) for r, c in enumerate((10.0, 12.0, 11.0))]
    samples += [sample("vllm", "hit", h, r, cached=3968) for r, h in enumerate((0.4, 0.5, 0.6))]
    samples += [sample("kvledger", "cold", c, r) for r, c in enumerate((11.0, 13.0, 12.0))]
    samples += [sample("kvledger", "hit", h, r, cached=3968) for r, h in enumerate((0.5, 0.6, 1.2))]
    samples += [sample("mooncake", "hit", 0.8, r, cached=3968) for r in range(3)]
    samples += [sample("vllm", "hit", 0.4, r, cached=3968) | {"phase": "fresh"} for r in range(3)]
    samples += [sample("vllm", "check_cold", 12.0, answer=[1, 2]), sample("vllm", "check_hit", 0.9, answer=[1, 2]),
                sample("kvledger", "check_hit", 1.0, answer=[1, 2]),
                sample("mooncake", "check_hit", 1.0, answer=[1, 3])]
    failures = {"simple_cpu_offload_disk": "worker.py:165 in register_kv_caches: AttributeError: ..."}
    roles = ["vllm", "kvledger", "mooncake", "simple_cpu_offload_disk"]
    report = hybrid_report.summarize(samples, [4096], 3, roles, failures, {}, 36864)
    (row,) = report["rows"]
    assert row["greedy_reference"] == [1, 2]
    v, k, m = row["vllm"], row["kvledger"], row["mooncake"]
    assert v["ttft_cold_s"] == {"median": 11.0, "min": 10.0, "max": 12.0} and v["hit_tokens"] == 3968
    assert "hit_over_vllm_prefix_hit" not in v and v["greedy_16_equal_cold"]
    assert k["ttft_hit_s"] == {"median": 0.6, "min": 0.5, "max": 1.2}
    assert v["ttft_hit_fresh_phase_s"]["median"] == 0.4   # vLLM's own hits beside the fresh processes'
    # each repeat's hit over vLLM's hit of the same moment (the fresh phase's): 0.5/0.4, 0.6/0.4, 1.2/0.4
    assert k["hit_over_vllm_prefix_hit"] == pytest.approx({"median": 1.5, "min": 1.25, "max": 3.0})
    assert k["hit_over_cold"]["median"] == pytest.approx(0.6 / 13.0) and k["greedy_16_equal_cold"]
    assert "ttft_cold_s" not in m and not m["greedy_16_equal_cold"]   # a wrong 16th token is reported
    assert row["simple_cpu_offload_disk"] == {"failed": failures["simple_cpu_offload_disk"]}
    assert report["target"]["by_size"]["4096"] == {"kvledger_hit_over_vllm_prefix_hit": pytest.approx(1.5),
                                                   "met": True}
    lines = hybrid_report.table_lines(report)
    assert lines[1][:5] == ["4,096", "kvledger (fresh process)", "12.00 (11.00–13.00)", "0.60 (0.50–1.20)", "3,968"]
    assert lines[3][2].startswith("failed: worker.py:165")


def test_bytes_per_cached_token_against_an_all_layers_store():
    # Gemma 3 270M under vLLM, float32: 3 full layers × 2,048 B per token in blocks, one snapshot of 15 windowed
    # layers × 512 tokens × 2,048 B per prompt; 3 prompts of 4,096 tokens
    held = {"kvledger_blocks": 3 * 4096 * 3 * 2048, "kvledger_snapshots": 3 * 15 * 512 * 2048,
            "mooncake": 3 * 4096 * 3 * 2048 + 3 * 5 * 4 * 786432}
    row = hybrid_report.bytes_row(4096, 3, held, 36864)
    assert row["stored_tokens"] == 3 * 4096 and row["kvledger_blocks"] == 6144
    assert row["kvledger"] == 6144 + 3840 and row["kvledger_over_all_layers"] == pytest.approx(9984 / 36864)
    assert row["mooncake"] == 6144 + 3840
    assert "mooncake" not in hybrid_report.bytes_row(4096, 3, {"kvledger_blocks": 1}, 36864)


def test_all_layers_bytes_come_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 18, "num_attention_heads": 4,
                                                      "num_key_value_heads": 1, "head_dim": 256}))
    assert all_layers_bytes_per_token(tmp_path) == 18 * 2 * 256 * 4 == 36864


def test_connector_times_pick_the_hit_and_the_saves_of_one_size():
    events = [{"event": "save", "req_id": "a", "ok": 20, "seconds": 0.5}, {"event": "save", "req_id": "a", "ok": 12,
               "seconds": 0.25}, {"event": "save", "req_id": "w", "ok": 4, "seconds": 0.1},
              {"event": "window_save", "req_id": "a", "position": 3968, "ok": 1, "seconds": 0.2},
              {"event": "load", "req_id": "b", "ok": 31, "seconds": 0.3, "waited_s": 0.1},
              {"event": "load", "req_id": "c", "ok": 3, "seconds": 9.0, "waited_s": 9.0},
              {"event": "window_load", "req_id": "b", "position": 3968, "ok": 1, "seconds": 0.05}]
    assert hybrid_report.connector_times(events, 4096) == {"load_s": 0.3, "load_waited_s": 0.1, "save_s": 0.75,
                                                           "window_load_s": 0.05, "window_save_s": 0.2}


def test_a_peers_failure_is_the_line_it_raised_with_its_frame(tmp_path):
    log = ['[rank0]:   File "/v/lib/python3.11/site-packages/vllm/v1/simple_kv_offload/worker.py", line 165, in '
           'register_kv_caches', "[rank0]:     low_pri, _ = torch.cuda.Stream.priority_range()",
           "[rank0]: AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'"]
    assert failure_line(log) == ("vllm/v1/simple_kv_offload/worker.py:165 in register_kv_caches: AttributeError: "
                                 "type object '_StreamPlaceholder' has no attribute 'priority_range'")
    assert failure_line(["INFO started", "INFO nothing wrong"]) == "INFO nothing wrong"
    (tmp_path / "snapshots" / "ab").mkdir(parents=True)
    (tmp_path / "snapshots" / "ab" / "x.snap").write_bytes(b"s" * 5)
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / "0.seg").write_bytes(b"b" * 7)
    assert bytes_under(tmp_path) == {"blocks": 7, "snapshots": 5}
