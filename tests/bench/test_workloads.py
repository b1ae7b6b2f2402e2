import numpy as np
import pytest

from kvledger.bench.workloads import (AgentConfig, ChatConfig, DocumentConfig, agent, chat, document, generate,
                                     prompt_tokens, sequence_tokens)
from kvledger.core import ModelSpec, chain_keys

SPEC = ModelSpec.preset("deepseek-v4.1-flash")


@pytest.mark.parametrize("name", ["chat", "agent", "document"])
def test_seeded_and_reproducible(name):
    a, b = generate(name, seed=3, sessions=20), generate(name, seed=3, sessions=20)
    c = generate(name, seed=4, sessions=20)
    assert a.requests == b.requests
    assert a.requests != c.requests
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)
    r = a.requests[-1]
    assert np.array_equal(prompt_tokens(r), prompt_tokens(b.requests[-1]))
    assert len(prompt_tokens(r)) == r.input_length and len(sequence_tokens(r)) == r.input_length + r.output_length


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("trace", [chat(ChatConfig(sessions=6, seed=1)), agent(AgentConfig(sessions=3, seed=1)),
                                   document(DocumentConfig(sessions=12, documents=3, seed=1))],
                         ids=["chat", "agent", "document"])
def test_block_ids_agree_with_chain_keys(trace):
    """Two requests share their first k block ids iff they share their first k chain keys (real tokens)."""
    reqs = trace.requests[:40]
    keys = [chain_keys(prompt_tokens(r).tolist(), SPEC) for r in reqs]
    for i in range(len(reqs)):
        for j in range(i + 1, len(reqs)):
            full_i = reqs[i].input_length // 128
            full_j = reqs[j].input_length // 128
            ids = _common(reqs[i].hash_ids[:full_i], reqs[j].hash_ids[:full_j])
            assert ids == _common(keys[i], keys[j]), (i, j)


def test_next_turn_reuses_prompt_and_output_blocks():
    by_session: dict[int, list] = {}
    for r in agent(AgentConfig(sessions=4, seed=2)).requests:
        by_session.setdefault(r.session, []).append(r)
    pairs = 0
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            full = prev.hash_ids[: prev.input_length // 128]
            written = full + prev.output_hash_ids
            assert nxt.hash_ids[: len(written)] == written
            pairs += 1
    assert pairs > 0


def test_agent_sessions_share_the_system_prompt():
    reqs = agent(AgentConfig(sessions=30, apps=2, seed=5)).requests
    firsts = {r.hash_ids[0] for r in reqs}
    assert len(firsts) == 2  # one per app: its system prompt is thousands of tokens long
    assert all(r.ttl_class == "agent" for r in reqs)
    assert all(r.ttl_class == "chatbot" for r in chat(ChatConfig(sessions=5)).requests)


def test_trace_requests_get_tokens_from_their_block_ids():
    from kvledger.bench.trace import DEFAULT_TRACE, read_trace

    reqs = read_trace(DEFAULT_TRACE).requests
    a, b = next((x, y) for x in reqs[:300] for y in reqs[:300]
                if x is not y and 2 < _common(x.hash_ids, y.hash_ids) < min(len(x.hash_ids), len(y.hash_ids)))
    ta, tb = prompt_tokens(a), prompt_tokens(b)
    assert len(ta) == a.input_length and len(tb) == b.input_length
    shared = _common(a.hash_ids, b.hash_ids)
    assert _common(chain_keys(ta.tolist(), SPEC), chain_keys(tb.tolist(), SPEC)) == shared * 512 // 128


def test_document_questions_share_their_document_and_part_after_it():
    """Each prompt is one of the documents, then a question of its own: two prompts on one document share its
    whole blocks and part inside the block where the document ends (the prefix none of them ends at)."""
    cfg = DocumentConfig(sessions=40, documents=2, seed=7)
    reqs = document(cfg).requests
    assert len(reqs) == 40 and all(len(r.segments) == 3 for r in reqs)   # document, question, reply
    by_doc: dict[int, list] = {}
    for r in reqs:
        by_doc.setdefault(r.segments[0].seed, []).append(r)
    assert len(by_doc) == 2
    for group in by_doc.values():
        doc = group[0].segments[0].length
        assert cfg.document_tokens[0] <= doc < cfg.document_tokens[1]
        for a, b in zip(group, group[1:]):
            assert _common(a.hash_ids, b.hash_ids) == doc // 128
