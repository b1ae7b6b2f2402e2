import argparse
import json
import subprocess
import sys

import pytest

from kvledger.demo.prompts import agent_prompt


def _one_json(out: str) -> dict:
    obj = json.loads(out)  # the whole of stdout is exactly one JSON object
    assert isinstance(obj, dict)
    return obj


def test_plan_json_published_figures(run_cli):
    r = run_cli("plan", "--model", "deepseek-v4.1-flash", "--tokens", "131072", "--json")
    assert r.returncode == 0, r.stderr
    p = _one_json(r.stdout)
    assert (p["block_bytes"], p["swa_snapshot_bytes"], p["hit_eligible_tokens"]) == (113920, 1415040, 130816)


def test_plan_table(run_cli):
    r = run_cli("plan", "--tokens", "8192", "--model", "tiny-v4")
    assert r.returncode == 0 and "hit-eligible tokens" in r.stdout and "7,936" in r.stdout


def test_diff_of_token_files(run_cli, tmp_path):
    a = list(range(2000))
    b = list(a)
    b[300] = 99999
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    r = run_cli("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json")
    assert r.returncode == 0, r.stderr
    d = _one_json(r.stdout)
    assert d["first_divergence"] == 300 and d["hit_blocks"] == 2
    assert d["context"]["a"][8] == 300 and d["context"]["b"][8] == 99999


def test_diff_of_texts_points_at_the_timestamp(run_cli, tmp_path):
    (tmp_path / "a.txt").write_text(agent_prompt("2026-11-29T10:21:04Z"))
    (tmp_path / "b.txt").write_text(agent_prompt("2026-11-29T10:25:37Z"))
    r = run_cli("diff", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--json")
    assert r.returncode == 0, r.stderr
    d = _one_json(r.stdout)
    assert 1800 <= d["len_a"] <= 2600 and 250 <= d["first_divergence"] <= 350
    assert d["hit_blocks"] == d["first_divergence"] // 128
    # the differing span decodes to the part of the timestamp that changed
    assert (d["context"]["a_differs"], d["context"]["b_differs"]) == ("1:04", "5:37")
    human = run_cli("diff", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert human.returncode == 0 and f"token {d['first_divergence']}" in human.stdout


def test_diff_inline_lists(run_cli):
    r = run_cli("diff", json.dumps(list(range(300))), json.dumps(list(range(300))), "--json",
                "--model", "smollm2-135m")
    d = _one_json(r.stdout)
    assert d["first_divergence"] is None and d["hit_blocks"] == 2 and d["hit_tokens"] == 256


def test_diff_and_plan_default_to_the_model_serve_runs(run_cli):
    """A newcomer's `kvledger diff` agrees with `kvledger serve`: 900 identical tokens hit 896 on serve's
    SmolLM2 (R = 1: ⌊899/128⌋·128), not DeepSeek-V4's 640 (R = 134: ⌊766/128⌋·128)."""
    from kvledger.cli import build_parser

    parser = build_parser()
    serve_model = parser.parse_args(["serve"]).model
    assert parser.parse_args(["diff", "[1]", "[1]"]).model == serve_model
    assert parser.parse_args(["plan", "--tokens", "1"]).model == serve_model
    ids = json.dumps(list(range(900)))
    d = _one_json(run_cli("diff", ids, ids, "--json").stdout)
    assert (d["model"], d["hit_tokens"]) == (serve_model, 896)
    p = _one_json(run_cli("plan", "--tokens", "900", "--json").stdout)
    assert (p["model"], p["hit_eligible_tokens"]) == (serve_model, 896)


def test_plan_prices_prefill_at_the_models_rate_and_shows_no_swa_rows_without_windows(run_cli):
    r = run_cli("plan", "--model", "smollm2-135m", "--tokens", "2048", "--json")
    assert r.returncode == 0, r.stderr
    p = _one_json(r.stdout)
    assert p["link"]["prefill_tokens_per_s"] == 800 and p["prefill_s"] == pytest.approx(2048 / 800)
    assert "measured" in p["prefill_source"]
    assert p["has_swa"] is False and (p["swa_snapshot_bytes"], p["inference_ring"], p["kvstore_ring"]) == (None,) * 3
    given = _one_json(run_cli("plan", "--model", "smollm2-135m", "--tokens", "2048", "--prefill-tps", "100",
                              "--json").stdout)
    assert given["prefill_s"] == pytest.approx(20.48) and given["prefill_source"] == "--prefill-tps"
    wide = {"COLUMNS": "200"}   # rich wraps the notes at 80 columns otherwise
    table = run_cli("plan", "--model", "smollm2-135m", "--tokens", "2048", env=wide)
    assert "no sliding-window layers" in table.stdout and "│ rings" not in table.stdout
    assert " 0 B" not in table.stdout and "800 tokens/s" in table.stdout
    v4 = run_cli("plan", "--model", "deepseek-v4.1-flash", "--tokens", "2048", env=wide)
    assert "│ rings" in v4.stdout and "1,415,040 B" in v4.stdout and "10,082 tokens/s" in v4.stdout


@pytest.mark.parametrize("args", [
    ("plan", "--tokens", "-1"),
    ("plan", "--tokens", "abc"),
    ("plan", "--tokens", "100", "--model", "gpt-9"),
    ("plan", "--tokens", "100", "--mix", "agent=2"),
    ("plan", "--tokens", "100", "--mix", "garbage"),
    ("plan",),
    ("diff", "/nonexistent/a.txt", "[1]"),
    ("diff", "[1, 2, \"x\"]", "[1]"),
    ("diff", "[1, 2.5]", "[1]"),
    ("diff", "[1, -3]", "[1]"),
    ("diff", "[1, 2", "[1]"),
    ("diff", "[1]", "[1]", "--model", "nope"),
    ("frobnicate",),
    (),
])
def test_bad_input_is_one_line_and_exit_2(run_cli, args):
    r = run_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvledger: error:")
    assert r.stdout == ""


def test_text_prompt_with_a_missing_tokenizer(run_cli, tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    r = run_cli("diff", str(tmp_path / "a.txt"), "[1]", "--tokenizer", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "no tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_demo_runs(run_cli):
    r = run_cli("demo", "--turns", "0")  # the chat runs in tests/test_demo_chat.py (slow)
    assert r.returncode == 0, r.stderr
    for part in ("capacity plan", "130,816", "130,688", "prompt diff", "snapshot hit of 2,176 tokens",
                 "17 of 17 blocks read back", "bytes identical", "byte-exact", "ceiling 0.640", "Try next"):
        assert part in r.stdout


def _tool_lines(parser: argparse.ArgumentParser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_the_tools_are_listed_as_they_describe_themselves(run_cli):
    """`kvledger --help` lists bench, whatif and demo from `TOOLS`, their modules unimported, in the words their
    own parsers use."""
    from kvledger.cli import TOOLS, build_parser

    listed = _tool_lines(build_parser(()))
    assert {name: listed[name] for name in TOOLS} == {name: _tool_lines(build_parser())[name] for name in TOOLS}
    r = run_cli("--help")
    assert r.returncode == 0 and all(f"    {name} " in r.stdout for name in TOOLS)


def test_a_bench_without_its_extra_is_one_line_and_exit_2():
    """Without the `bench` extra (None in sys.modules reads as not installed) `kvledger bench` says what to
    install, in one line, and exits 2, before importing any bench."""
    code = ("import sys\n"
            "sys.modules['matplotlib'] = sys.modules['zmq'] = None\n"
            "from kvledger.cli import main\n"
            "try:\n"
            "    main(['bench', 'store', '--json'])\n"
            "finally:\n"
            "    assert not [m for m in sys.modules if m.startswith('kvledger.bench')]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines() == ["kvledger: error: `kvledger bench` needs the bench extra (no module matplotlib, "
                                     "zmq): pip install 'kvledger[bench]'"]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of every subcommand under `parser`, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def _option_text(help_text: str, option: str) -> str:
    """The lines `--help` gives one option: its invocation line and the indented lines after it."""
    lines = help_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  " + option))
    block = [lines[start]]
    for ln in lines[start + 1:]:
        if not ln.startswith("   "):
            break
        block.append(ln)
    return " ".join(block)


def test_every_command_has_a_description_an_example_and_shows_its_defaults(monkeypatch):
    from kvledger.cli import build_parser
    from kvledger.util.output import shows_default

    monkeypatch.setenv("COLUMNS", "1000")   # one line per option: a default is never split
    commands = list(_commands(build_parser()))
    names = {" ".join(path) for path, _ in commands}
    assert {"plan", "diff", "demo", "serve", "entrypoint", "engine", "up", "store stats", "store gc",
            "store verify", "bench store", "bench ttft", "bench sim"} <= names
    for path, parser in commands:
        cmd = "kvledger " + " ".join(path)
        assert parser.description and parser.description.strip(), cmd
        assert parser.epilog and "example" in parser.epilog and cmd in parser.epilog, cmd
        text = parser.format_help()
        for action in parser._actions:
            if action.option_strings and shows_default(action):
                option = action.option_strings[-1]
                assert str(action.default) in _option_text(text, option), f"{cmd} {option}: {action.default!r}"
