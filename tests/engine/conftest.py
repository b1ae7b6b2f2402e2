"""Engine fixtures: one SmolLM2 engine per module on a fresh embedded block ledger.

Torch runs one intra-op thread here: on a loaded 2-core machine a second thread spins and
slows every op (measured: a decode step 1.9 s with 2 threads, 0.42 s with 1)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    from kvledger.store.ledger import BlockLedger

    with BlockLedger.open(path=tmp_path_factory.mktemp("blocks"), fsync=False) as led:
        yield led


@pytest.fixture(scope="module")
def smollm2(ledger):
    from kvledger.engine.engine import Engine

    engine = Engine("smollm2-135m", block_ledger=ledger, kv_cache_bytes=96 << 20, max_num_batched_tokens=1024,
                    stream_hits=True)   # whatever the CPU count: the streamed hit's paths are tested here
    engine.record_logits = True
    yield engine
    engine.close()
