"""`kvledger bench NAME --record DIR`: the run kept as the JSON it printed, with where and when it ran."""

import json


def test_a_recorded_run_is_the_printed_json_plus_its_run(run_cli, tmp_path):
    r = run_cli("bench", "sim", "--sessions", "20", "--record", str(tmp_path / "results"))
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    (kept,) = (tmp_path / "results").glob("sim-*.json")
    assert json.loads(kept.read_text()) == printed
    run = printed["run"]
    assert run["command"] == f"kvledger bench sim --sessions 20 --record {tmp_path / 'results'}"
    assert run["bench"] == "sim" and run["date"].endswith("Z") and run["cores"] >= 1
    assert len(run["load_avg_before"]) == len(run["load_avg_after"]) == 3
    assert run["commit"] is None or len(run["commit"].removesuffix("-dirty")) == 40
    assert printed["block_hit_rate"] >= 0   # the bench's own figures are all there


def test_a_run_records_the_kvledger_switches_it_ran_with(tmp_path, monkeypatch, capsys):
    """`KVLEDGER_*` variables turn kernels on or off: two runs of one commit may differ by them alone."""
    from types import SimpleNamespace

    from kvledger.bench import record

    monkeypatch.setenv("KVLEDGER_PROMPT_ATTEND", "0")
    monkeypatch.setenv("NOT_OURS", "x")
    record.recorded("fake", lambda args: print(json.dumps({"figure": 1})))(SimpleNamespace(record=str(tmp_path),
                                                                                          json=False))
    (kept,) = tmp_path.glob("fake-*.json")
    env = json.loads(kept.read_text())["run"]["env"]
    assert env["KVLEDGER_PROMPT_ATTEND"] == "0" and "NOT_OURS" not in env


def test_an_unwritable_record_folder_is_one_line(run_cli, tmp_path):
    (tmp_path / "file").write_text("")
    r = run_cli("bench", "sim", "--record", str(tmp_path / "file" / "results"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--record" in r.stderr, r.stderr


def test_the_commit_is_the_one_checked_out_when_the_run_started(tmp_path, monkeypatch, capsys):
    """A run takes minutes and a commit may land meanwhile: the file names the code that ran."""
    from types import SimpleNamespace

    from kvledger.bench import record

    head = ["a" * 40]
    monkeypatch.setattr(record, "checkout_commit", lambda: head[0])

    def run(args):
        head[0] = "b" * 40   # a commit lands while the bench runs
        print(json.dumps({"figure": 1}))

    record.recorded("fake", run)(SimpleNamespace(record=str(tmp_path), json=False))
    (kept,) = tmp_path.glob("fake-*.json")
    assert json.loads(kept.read_text())["run"]["commit"] == "a" * 40
