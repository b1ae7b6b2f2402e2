"""`kvledger bench store`: a small run through the CLI gives every figure with its baseline."""

import json

import pytest

KEYS = ("read_ratio", "write_ratio", "check_ms_1m_embedded", "check_ratio_1m", "read_bytes_per_s",
        "write_bytes_per_s", "plain_read_bytes_per_s", "plain_write_bytes_per_s")


def test_small_run_json_has_the_contract_keys(run_cli, tmp_path):
    out = tmp_path / "out"
    r = run_cli("bench", "store", "--json", "--out", str(out), "--total-mb", "8", "--blocks-per-put", "16",
                "--reps", "2", "--check-reps", "3", "--check-tokens", "8192,1048576", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for k in KEYS:
        assert isinstance(res[k], float) and res[k] > 0, k
    assert res["block_bytes"] == 113920 and res["check_tokens"] == [8192, 1048576]
    # the redis figure is measured in the same run, and the list → array conversion is reported apart
    assert res["check_ms_1m_redis"] > 0 and res["check_ms_1m_list_to_array"] > 0
    assert res["check_ms_1m_baseline"] > res["check_ms_1m_embedded"]
    assert json.loads((out / "store.json").read_text())["read_ratio"] == res["read_ratio"]
    assert (out / "store_io.png").stat().st_size > 0 and (out / "store_check.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the bench removed its files


def test_bad_input_exits_2(run_cli, tmp_path):
    for args in (["--check-tokens", "12"], ["--reps", "0"], ["--dir", str(tmp_path / "nope")],
                 ["--model", "nope"]):
        r = run_cli("bench", "store", "--json", "--no-redis", *args)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, args


@pytest.fixture(scope="module")
def full_run():
    import subprocess
    import sys
    from pathlib import Path

    kvledger = Path(sys.executable).parent / "kvledger"
    r = subprocess.run([str(kvledger), "bench", "store", "--json"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_full_run_io_targets_and_check_floor(full_run):
    assert full_run["read_ratio"] >= 0.8 and full_run["write_ratio"] >= 0.7
    assert full_run["check_ms_1m_embedded_min"] < 15


@pytest.mark.slow
def test_full_run_check_targets(full_run):
    assert full_run["check_ms_1m_embedded"] < 15 and full_run["check_ratio_1m"] <= 0.25


def test_explained_check_figures(run_cli, tmp_path):
    """`--explained` (issue 24): match_explained beside match, embedded and Redis, each case; Redis also beside the
    CHECK script of before tombstones."""
    r = run_cli("bench", "store", "--json", "--total-mb", "1", "--blocks-per-put", "4", "--reps", "1",
                "--check-reps", "1", "--check-tokens", "8192", "--explained", "--explained-keys", "4,16",
                "--explained-reps", "3", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["explained_keys"] == [4, 16]
    for n in (4, 16):
        for name, cases, variants in (("embedded", ("hit", "half"), ("plain", "explained")),
                                      ("redis", ("hit", "half", "refresh"), ("plain", "explained", "pre"))):
            for case in cases:
                assert res[f"explained_ratio_{name}_{n}_{case}"] > 0
                for v in variants:
                    key = f"explained_{name}_{n}_{case}_{v}"
                    assert 0 < res[f"{key}_p50_ms"] <= res[f"{key}_p99_ms"]
        assert res[f"tombstone_ratio_{n}_refresh"] > 0
    r = run_cli("bench", "store", "--json", "--no-redis", "--explained", "--explained-keys", "1")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
