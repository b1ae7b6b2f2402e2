"""`kvledger bench mount`, run tiny through the CLI: the JSON's keys and their sanity (not timings)."""

import json

import pytest

from kvledger.util.juicefs import fuse_unavailable

SIZES = (4, 12)
TIMED = [f"check_{n}" for n in SIZES] + [f"put_{n}_{f}" for n in SIZES for f in ("fsync", "no_fsync")] + \
        [f"read_{w}_{n}" for w in ("first", "repeat") for n in SIZES] + [f"fsync_cost_{n}" for n in SIZES]
TINY = ("--reps", "3", "--open-reps", "2", "--open-small", "20", "--open-blocks", "200",
        "--blocks-per-segment", "10", "--model", "tiny-v4")


def _sane(fig: dict, signed: bool = False) -> None:
    assert set(fig) == {"p50", "p90"} and fig["p50"] <= fig["p90"], fig
    assert signed or fig["p50"] > 0, fig


@pytest.mark.skipif(fuse_unavailable() is not None, reason=str(fuse_unavailable()))
def test_a_tiny_run_gives_every_figure_for_every_side(run_cli, tmp_path):
    record = tmp_path / "results"
    r = run_cli("bench", "mount", "--json", "--dir", str(tmp_path), "--record", str(record), *TINY, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert (res["bench"], res["model"], res["block_bytes"], res["reps"]) == ("mount", "tiny-v4", 18816, 3)
    assert set(res["ms"]) == set(TIMED)
    for figure, per_side in res["ms"].items():
        sides = {"local", "juicefs", "juicefs_no_cache"} if figure.startswith("read_") else {"local", "juicefs"}
        assert set(per_side) == sides, figure
        for fig in per_side.values():
            _sane(fig, signed=figure.startswith("fsync_cost"))
    small, big = res["open"]["points"]
    assert (small["small_blocks"], big["small_blocks"]) == (20, 200)
    for point in (small, big):
        assert set(point["ms"]) == {"open", "first_check", "first_read", "total"}
        for part in point["ms"].values():
            assert set(part) == {"local", "juicefs"} and all(_sane(f) is None for f in part.values())
        assert point["listings"] == {"local": 0, "juicefs": 0}   # opening lists nothing, at any size
        assert point["segments"]["local"] == point["segments"]["juicefs"] > 0
    assert big["segments"]["local"] - small["segments"]["local"] == 18 + 2   # 180 small blocks / 10, 2 probes
    assert big["file_opens_per_open"] == small["file_opens_per_open"]        # O(1): the same files opened
    assert set(res["open"]["total_p50_ratio"]) == {"local", "juicefs"}
    assert all(len(res["load_avg"][k]) == 3 for k in ("before", "after"))
    kept = list(record.glob("mount-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["run"]["bench"] == "mount"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]   # its folders removed, mounts gone


def test_bad_input_is_one_line_and_exit_2(run_cli, tmp_path):
    for args in (["--reps", "1"], ["--open-small", "10", "--open-blocks", "5"], ["--model", "nope"],
                 ["--dir", str(tmp_path / "nope")], ["--small-bytes", "0"]):
        r = run_cli("bench", "mount", "--json", *args)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_help_shows_the_defaults_and_an_example(run_cli):
    r = run_cli("bench", "mount", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for needle in ("(default: 1000000)", "(default: 30)", "(default: smollm2-135m)", "kvledger bench mount --json"):
        assert needle in text, needle
