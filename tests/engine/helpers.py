"""Helpers of the engine tests."""

import numpy as np

from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.entrypoint.check import check_prompt


def run_request(engine, ledger, tokens, *, request_id, max_tokens=8, namespace="default", state_ledger=None,
                replay=False):
    """CHECK, add, step to the end; (output tokens, usage of the last event, decision)."""
    keys, decision = check_prompt(tokens, engine.spec, block_ledger=ledger, state_ledger=state_ledger,
                                  namespace=namespace, replay=replay)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineRequest(request_id, tokens, keys, decision, sampling, namespace=namespace))
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
