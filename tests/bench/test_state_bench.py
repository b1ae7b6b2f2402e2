"""`kvledger bench state`: its JSON carries the figures side by side with the baseline."""

import json

import pytest


@pytest.fixture(scope="module")
def run_cli_module():
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "kvledger"
    return lambda *a: subprocess.run([str(exe), *a], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, run_cli_module):
    out = tmp_path_factory.mktemp("state-bench")
    r = run_cli_module("bench", "state", "--json", "--pulls", "10", "--rounds", "2", "--entries", "300",
                       "--lookups", "50", "--batch", "16", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), out


def test_json_has_pulls_side_by_side_and_directory_rates(small_run):
    res, _ = small_run
    assert res["snapshot_bytes"] == 1_415_040 and res["model"] == "deepseek-v4.1-flash"
    assert set(res["pull"]) == {"kvledger", "plain_socket", "plain_scatter", "plain_checksum", "asyncio_streams",
                                "zeromq"}
    for name, s in res["pull"].items():
        assert s["pulls"] == 20, name
        assert 0 < s["median_ms"] <= s["p99_ms"], name
        assert s["throughput_gb_s"] > 0 and s["server_cpu_us_per_pull"] >= 0, name
    assert len(res["pull_ratio_rounds"]) == 2 and res["pull_ratio"] > 0  # per round, kvledger over plain
    assert min(res["pull_ratio_rounds"]) <= res["pull_ratio"] <= max(res["pull_ratio_rounds"])
    assert res["pull_ratio_vs_scatter"] > 0 and res["pull_ratio_vs_checksum"] > 0
    assert res["client_misses"] == {}  # every pull hit
    assert set(res["directory"]) == {"embedded", "redis", "redis_get"}
    for name in ("embedded", "redis", "redis_get"):
        d = res["directory"][name]
        assert d["lookups_per_s"] > 0 and d["batched_keys_per_s"] > 0 and d["batch"] == 16
    assert res["redis"] == "private redis-server"
    assert set(res["candidates"]) == {"asyncio_streams", "zeromq"}


def test_out_writes_json_and_chart(small_run):
    res, out = small_run
    assert json.loads((out / "state_bench.json").read_text()) == res
    assert (out / "state_pulls.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_against_a_given_redis(run_cli, shared_redis):
    r = run_cli("bench", "state", "--json", "--pulls", "5", "--rounds", "1", "--entries", "100", "--lookups", "20",
                "--batch", "8", "--no-candidates", "--redis-url", shared_redis.url)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["redis"] == "given" and "candidates" not in res
    assert set(res["pull"]) == {"kvledger", "plain_socket", "plain_scatter", "plain_checksum"}
    import redis

    assert not redis.Redis.from_url(shared_redis.url).keys("kvl:bench:*")  # it cleaned up after itself


@pytest.mark.parametrize("args", [["--pulls", "0"], ["--model", "nope"], ["--model", "smollm2-135m"],
                                  ["--batch", "50", "--entries", "10"], ["--timeout", "-1"]])
def test_bad_input_is_one_line_and_exit_2(run_cli, args):
    r = run_cli("bench", "state", "--json", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("kvledger: error: ") and r.stderr.count("\n") == 1
