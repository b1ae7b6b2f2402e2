"""A published public prefix under a real vLLM with the connector (DESIGN rule 12): a request's `cache_salt` is
its tenant; 64 tenants send one published prefix (2 whole blocks and a few tokens more), each with a question of
its own. The first computes the prefix and the connector stores its blocks as the public namespace's; every
other tenant loads exactly those 2 blocks (never another tenant's question, though tenant 1 asks tenant 0's
question word for word), and the answers equal a plain vLLM's (no connector, no prefix caching).
"""

from __future__ import annotations

import json

import pytest

from kvledger.integrations.vllm.client import VLLM_PYTHON, VllmProcess, wait_all
from kvledger.integrations.vllm.prompts import long_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="run `make vllm-venv`")]

TENANTS = 64
PUBLIC = 2 * 128
MAX_TOKENS = 4
DTYPE = "float32"


def test_64_salts_compute_a_published_prefix_once_and_load_none_of_each_others_questions(tmp_path):
    from kvledger.engine.models.registry import resolve

    model = str(resolve("smollm2-135m").weights.folder())
    prefix = long_prompt(PUBLIC + 20)
    questions = [long_prompt(150, variant=1 + i)[:150] for i in range(TENANTS)]
    questions[1] = questions[0]   # tenant 1 asks tenant 0's question: its private blocks must still be its own
    (tmp_path / "public.json").write_text(json.dumps([prefix]))
    with_connector = VllmProcess({"model": model, "connector": "kvledger", "store": str(tmp_path / "store"),
                                  "public_prefix": str(tmp_path / "public.json"), "dtype": DTYPE})
    plain = VllmProcess({"model": model, "connector": None, "dtype": DTYPE})
    wait_all([with_connector, plain])
    try:
        got = [with_connector.generate(prefix + q, max_tokens=MAX_TOKENS, salt=f"tenant-{i}")
               for i, q in enumerate(questions)]
        want = [plain.generate(prefix + q, max_tokens=MAX_TOKENS)["tokens"] for q in questions[:3]]
    finally:
        with_connector.__exit__(None, None, None)
        plain.__exit__(None, None, None)
    loaded = [g["kv_transfer_params"]["kvledger"]["loaded_tokens"] for g in got]
    assert loaded == [0] + [PUBLIC] * (TENANTS - 1)
    assert [g["tokens"] for g in got[:3]] == want
