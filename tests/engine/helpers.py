"""Helpers of the engine tests."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.entrypoint.check import check_prompt


def run_request(engine, ledger, tokens, *, request_id, max_tokens=8, namespace="default", state_ledger=None,
                replay=False, spec=None, prompt_len=0):
    """CHECK, add, step to the end; (output tokens, usage of the last event, decision). `spec`: the one the
    CHECK decides with (default the engine's; `approximate(spec)` asks for the fallback). `prompt_len`: a later
    leg's request prompt (`tokens` continue it), as the entrypoint sends it."""
    keys, decision = check_prompt(tokens, spec or engine.spec, block_ledger=ledger, state_ledger=state_ledger,
                                  namespace=namespace, replay=replay, prompt_len=prompt_len or None)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineRequest(request_id, tokens, keys, decision, sampling, namespace=namespace,
                                     prompt_len=prompt_len))
    out, usage = drain(engine)
    engine.wait_stored()
    return out, usage, decision


def drain(engine):
    """Step until nothing runs; (every token produced, the last usage seen). Checks the pools after."""
    out, usage = [], None
    while engine.has_unfinished():
        for event in engine.step():
            out += event.token_ids
            usage = event.usage or usage
    engine.check_integrity()
    return out, usage


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def flip_byte_of_block(store_root, key: bytes) -> Path:
    """Damage one stored block on disk, as a bad sector would: flip the first byte of `key`'s bytes in
    its segment file (the index still lists it; only its checksum can tell). The segment's path."""
    from kvledger.store import segment as sg

    for path in (Path(store_root) / "segments").rglob("*" + sg.SUFFIX):
        fd = os.open(path, os.O_RDWR)
        try:
            entry = next((e for e in sg.read_meta(fd).entries if e[0] == key), None)
            if entry is not None:
                offset = entry[5]
                os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
                return path
        finally:
            os.close(fd)
    raise AssertionError(f"no segment under {store_root} holds block {key.hex()}")


def approximate(spec):
    """The same model (same fingerprint, same keys) deciding as V4 does: the truncated-window fallback when
    L1 has no snapshot (rule 3), instead of rule 3′'s exact resume. For tests of the fallback itself."""
    from dataclasses import replace

    return replace(spec, approximate_fallback=True)


def run_python(code: str) -> str:
    """`code` (indented as a test writes it) in a fresh interpreter, where no other test's OpenMP teams are; its
    stdout. Fails on its failure, with its stderr."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
