"""Hostile command lines: every bad input is one line on stderr and exit 2 (never "internal error", exit 1);
JSON output is standard JSON (never NaN or Infinity); absurd sizes are refused with their limit named."""

from __future__ import annotations

import json

import pytest


def _strict(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("edges")
    (d / "a.txt").write_text("hello there")
    (d / "deep.json").write_text("[" * 100_000)
    (d / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    (d / "notgguf.gguf").write_bytes(b"nothing like a model file")
    (d / "store" / "segments").mkdir(parents=True)
    base = '"output_length": 1, "hash_ids": [1, 2]'
    lines = {"nan_ts": '{"timestamp": NaN, "input_length": 1024, ' + base + "}",
             "inf_len": '{"timestamp": 1, "input_length": Infinity, ' + base + "}",
             "huge_len": '{"timestamp": 1, "input_length": 1e300, ' + base + "}",
             "huge_seg": '{"timestamp": 1, "input_length": 1024, ' + base + ', "segments": [[1, 1e400]]}',
             "deep": '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": ' + "[" * 100_000 + "}"}
    for name, line in lines.items():
        (d / f"{name}.jsonl").write_text(line + "\n")
    return d


CASES = {
    "nan flag": (["plan", "--tokens", "1000", "--fetch-gbps", "nan"], "'nan'"),
    "inf flag": (["plan", "--tokens", "1000", "--reuse", "inf"], "'inf'"),
    "inf in a pair": (["plan", "--tokens", "1000", "--ttl", "agent=inf"], "agent=inf"),
    "nan in a pair": (["plan", "--tokens", "1000", "--mix", "agent=nan,chatbot=0.5"], "agent=nan"),
    "absurd tokens": (["plan", "--tokens", str(10**20)], "1,073,741,824"),
    "absurd requests": (["plan", "--tokens", "1000", "--requests-per-day", "1e300"], "1e+12"),
    "sim nan flag": (["bench", "sim", "--workload", "chat", "--span-days", "nan"], "'nan'"),
    "negative seed": (["bench", "sim", "--workload", "chat", "--seed", "-1"], "--seed"),
    "absurd sessions": (["bench", "sim", "--workload", "chat", "--sessions", str(10**8)], "100,000"),
    "trace nan": (["bench", "sim", "--trace", "{d}/nan_ts.jsonl"], "NaN"),
    "trace inf": (["bench", "sim", "--trace", "{d}/inf_len.jsonl"], "Infinity"),
    "trace absurd length": (["bench", "sim", "--trace", "{d}/huge_len.jsonl"], "16,777,216"),
    "trace absurd segment": (["bench", "sim", "--trace", "{d}/huge_seg.jsonl"], "segments"),
    "trace deep list": (["bench", "sim", "--trace", "{d}/deep.jsonl"], "deep"),
    "deep JSON prompt": (["diff", "{d}/deep.json", "[1]"], "deep"),
    "NaN in a prompt": (["diff", "[1, NaN]", "[1]"], "NaN"),
    "bad gguf": (["diff", "{d}/a.txt", "{d}/a.txt", "--tokenizer", "{d}/bad.gguf"], "GGUF"),
    "not a gguf": (["diff", "{d}/a.txt", "{d}/a.txt", "--tokenizer", "{d}/notgguf.gguf"], "GGUF"),
    "tiny capacity": (["store", "gc", "--path", "{d}/store", "--store-capacity", "1e-12"], "one byte"),
    "huge capacity": (["store", "gc", "--path", "{d}/store", "--store-capacity", "1e300"], "exabyte"),
    "store bench absurd size": (["bench", "store", "--total-mb", "1e300", "--no-redis"], "limit"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(run_cli, files, case):
    args, says = CASES[case]
    r = run_cli(*[a.format(d=files) for a in args], "--json", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("kvledger: error:") and "internal error" not in r.stderr
    assert says in r.stderr, r.stderr


def test_json_output_is_strict_when_a_figure_overflows(run_cli):
    r = run_cli("plan", "--tokens", "1000", "--prefill-tps", "1e-320", "--json")
    assert r.returncode == 0, r.stderr
    out = _strict(r.stdout)
    assert out["prefill_s"] is None  # infinite: null, never Infinity
