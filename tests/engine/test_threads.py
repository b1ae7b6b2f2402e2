"""engine/threads.py: the torch thread count of `serve`, `engine`, `up` and the engine benches — --threads, else
$OMP_NUM_THREADS, else the CPUs this process may run on less one left free; and the one-line refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvledger.engine.threads import (OPENMP_LIB, colocated_stream_hits, default_threads, peer_environment,
                                     resolve_threads, stream_hits, threads_per_process, usable_cpus)
from tests.engine.helpers import run_python

NO_QUOTA = "max 100000\n"


@pytest.fixture
def cpu_max(tmp_path):
    """A cgroup v2 `cpu.max` of the test's own; write its text with `.write_text`."""
    path = tmp_path / "cpu.max"
    path.write_text(NO_QUOTA)
    return path


def test_usable_cpus_are_the_affinity_mask_capped_by_the_cgroup_quota(cpu_max, tmp_path):
    mask = len(os.sched_getaffinity(0))
    assert usable_cpus(cpu_max) == mask
    assert usable_cpus(tmp_path / "no such file") == mask   # cgroup v1, or none: the mask alone
    cpu_max.write_text("50000 100000\n")   # half a CPU: rounds up to one
    assert usable_cpus(cpu_max) == 1
    cpu_max.write_text(f"{(mask + 7) * 100000} 100000\n")   # a quota above the mask: the mask
    assert usable_cpus(cpu_max) == mask
    cpu_max.write_text("garbage\n")
    assert usable_cpus(cpu_max) == mask


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (3, 2), (4, 3), (16, 15), (192, 191)])
def test_the_default_leaves_one_cpu_free_where_two_remain_to_compute(cpus, threads):
    assert default_threads(cpus) == threads


def test_the_flag_then_omp_num_threads_then_the_usable_cpus_less_one(cpu_max):
    mask = len(os.sched_getaffinity(0))
    assert resolve_threads(3, env={"OMP_NUM_THREADS": "1"}, cpu_max=cpu_max) == 3
    assert resolve_threads(None, env={"OMP_NUM_THREADS": "5"}, cpu_max=cpu_max) == 5
    assert resolve_threads(None, env={"OMP_NUM_THREADS": " 4,2 "}, cpu_max=cpu_max) == 4   # nested: the outer level
    assert resolve_threads(None, env={}, cpu_max=cpu_max) == default_threads(mask)
    cpu_max.write_text("100000 100000\n")   # a container's --cpus 1
    assert resolve_threads(None, env={}, cpu_max=cpu_max) == 1
    cpu_max.write_text("300000 100000\n")   # --cpus 3 (or the mask, if it holds fewer)
    assert resolve_threads(None, env={}, cpu_max=cpu_max) == default_threads(min(mask, 3))


@pytest.mark.parametrize("requested, env, says", [(0, {}, "--threads must be >= 1"),
                                                  (-2, {}, "--threads must be >= 1"),
                                                  (None, {"OMP_NUM_THREADS": "many"}, "OMP_NUM_THREADS='many'"),
                                                  (None, {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0'")])
def test_a_count_that_is_not_one_is_refused(cpu_max, requested, env, says):
    with pytest.raises(ValueError, match=says):
        resolve_threads(requested, env=env, cpu_max=cpu_max)


def test_up_shares_the_cpus_among_its_engines(cpu_max):
    cpu_max.write_text("1600000 100000\n")   # 16 CPUs by quota (the mask may hold fewer: then those)
    cpus = usable_cpus(cpu_max)
    assert threads_per_process(None, 3, env={}, cpu_max=cpu_max) == max(default_threads(cpus) // 3, 1)
    assert threads_per_process(None, 100, env={}, cpu_max=cpu_max) == 1
    assert threads_per_process(2, 3, env={}, cpu_max=cpu_max) == 2
    assert threads_per_process(None, 3, env={"OMP_NUM_THREADS": "6"}, cpu_max=cpu_max) == 6


def test_up_streams_hits_only_when_its_engines_together_leave_a_cpu_free(cpu_max):
    """Each engine alone would see its one thread on a 2-CPU machine as a core free; `up` counts them all."""
    cpu_max.write_text("200000 100000\n")   # 2 CPUs (fewer if the mask has fewer)
    two = usable_cpus(cpu_max) >= 2
    assert colocated_stream_hits("auto", 1, 2, cpu_max=cpu_max) == "off"
    assert colocated_stream_hits("auto", 1, 1, cpu_max=cpu_max) == ("on" if two else "off")
    assert colocated_stream_hits("on", 1, 2, cpu_max=cpu_max) == "on"
    assert colocated_stream_hits("off", 1, 1, cpu_max=cpu_max) == "off"
    assert [stream_hits(c) for c in ("auto", "on", "off")] == [None, True, False]


@pytest.mark.parametrize("name, runtime", [("libgomp.so.1", True), ("libgomp-a34b3233.so.1", True),
                                           ("libiomp5.so", True), ("libomp.so", True), ("libomptarget.so", False),
                                           ("libgomp_helper.so", False), ("libtorch_cpu.so", False)])
def test_the_openmp_runtimes_are_told_from_other_libraries_by_name(name, runtime):
    assert bool(OPENMP_LIB.fullmatch(name)) is runtime


@pytest.mark.parametrize("args, env, says", [
    (["serve", "--data-dir", "{tmp}", "--threads", "0"], {}, "--threads must be >= 1, got 0"),
    (["serve", "--data-dir", "{tmp}"], {"OMP_NUM_THREADS": "x"}, "OMP_NUM_THREADS='x' is not a thread count"),
    (["up", "--threads", "-1"], {}, "--threads must be >= 1, got -1"),
    (["engine", "--role", "both", "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", "{tmp}", "--threads", "0"],
     {"KVLEDGER_CLUSTER_TOKEN": "t" * 64}, "--threads must be >= 1, got 0"),
    (["bench", "ttft", "--threads", "0"], {}, "--threads must be >= 1, got 0"),
])
def test_a_bad_thread_count_is_one_line_and_exit_2(run_cli, tmp_path, args, env, says):
    r = run_cli(*[a.format(tmp=tmp_path) for a in args], env=env, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("kvledger: error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert says in r.stderr, r.stderr


def test_release_team_ends_the_calling_threads_openmp_workers_and_computing_brings_them_back():
    out = run_python("""
        import os, torch
        from kvledger.engine.threads import release_team
        tids = lambda: set(os.listdir("/proc/self/task"))
        torch.set_num_threads(2)                 # one worker beside this thread, whatever the CPU count
        a = torch.randn(1024, 1024)
        before = tids(); product = a @ a; workers = tids() - before
        assert workers, "the matmul started no OpenMP worker"
        assert release_team()
        assert not workers & tids(), "the workers outlived the release"
        again = a @ a
        assert len(tids() - before) == len(workers), "computing again brought no team back"
        assert torch.equal(again, product)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_idle_workers_spin_briefly_unless_the_user_chose_how_they_wait():
    """`limit_spinning`: GOMP_SPINCOUNT=2000, marked as kvledger's, where the user set none of the standard's, GNU's
    or Intel's settings; the user's own choice untouched; a program that is not kvledger's gets the user's
    environment back."""
    from kvledger.engine.threads import SPIN_COUNT_MARK, limit_spinning

    env = {"PATH": "/bin"}
    assert limit_spinning(env) and env["GOMP_SPINCOUNT"] == "2000" and env[SPIN_COUNT_MARK] == "1"
    assert limit_spinning(env)                       # a child of a kvledger process: already kvledger's
    assert peer_environment(env) == {"PATH": "/bin"}
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200")):
        mine = {name: value}
        assert not limit_spinning(mine) and mine == {name: value}
        assert peer_environment(mine) == mine


def test_the_cli_sets_the_spin_count_before_torch_loads_its_openmp_runtime():
    """The runtime itself says how long its idle workers spin (OMP_DISPLAY_ENV=VERBOSE, printed as it initialises;
    torch's GNU OpenMP spins 300,000 times by default): 2,000 after `kvledger.cli.main` ran a command, in a process
    that imports torch only afterwards, as every command does."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from kvledger.cli import main
        assert "torch" not in sys.modules
        main(["plan", "--model", "tiny-v4", "--tokens", "1000", "--json"])
        import torch
        torch.ones(64, 64) @ torch.ones(64, 64)
    """)], capture_output=True, text=True, timeout=120,
        env={**peer_environment(), "OMP_DISPLAY_ENV": "VERBOSE"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "GOMP_SPINCOUNT = '2000'" in done.stderr, done.stderr[-2000:]   # torch's Linux x86-64 wheels: GNU OpenMP
