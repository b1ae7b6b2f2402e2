"""`kvledger.util.output`: a Ctrl-C held over code that would report it on stderr."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvledger.util.output import interrupts_held


def test_a_ctrl_c_inside_the_block_is_raised_when_it_ends_not_inside():
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        signal.raise_signal(signal.SIGINT)
        reached_the_end = True
    assert reached_the_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_ctrl_c_nothing_is_raised_and_the_handler_is_restored():
    with interrupts_held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_ctrl_c_goes_to_the_handler_that_was_in_place():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_prometheus_clients_import_prints_nothing_of_its_generated_code():
    """prometheus_client's vendored `decorator` prints "Error in generated code:" and the source when an
    exception lands in its exec: the import under `interrupts_held` (as `entrypoint.metrics` does it) ends
    in the KeyboardInterrupt alone. The Ctrl-C is raised inside the exec, deterministically, by wrapping it."""
    code = """
import builtins, signal, sys
real_exec = builtins.exec
def exec_then_ctrl_c(*args, **kw):
    if sys._getframe(1).f_globals.get("__name__") == "prometheus_client.decorator":
        signal.raise_signal(signal.SIGINT)
    return real_exec(*args, **kw)
builtins.exec = exec_then_ctrl_c
from kvledger.util.output import interrupts_held
try:
    with interrupts_held():
        import prometheus_client
except KeyboardInterrupt:
    print("interrupted after the import:", "prometheus_client" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stderr == "", out.stderr
    assert out.stdout.strip() == "interrupted after the import: True"
