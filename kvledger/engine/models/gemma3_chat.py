"""Gemma's turn format, for a Gemma 3 GGUF that carries no chat template (the 270M base model's does not).

    <bos><start_of_turn>user
    {system}\n\n{first user message}<end_of_turn>
    <start_of_turn>model
    {assistant message}<end_of_turn>
    <start_of_turn>user
    ...
    <start_of_turn>model                       ← the generation prompt

Gemma has no system turn: a leading system message is the first user turn's opening paragraph. Turns
alternate user, model, user, ...; anything else is a one-line error (a 400). The model's turn ends with
`<end_of_turn>`, which a chat request stops at (`END_OF_TURN`). Message content is never trimmed or altered,
so `ChatTemplate.tokenize` keeps control tokens out of it.
"""

END_OF_TURN = "<end_of_turn>"

TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{% if system is not none and not turns %}"
    "{{ raise_exception('Gemma 3 needs a user message after the system message') }}{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] not in ('user', 'assistant') %}"
    "{{ raise_exception('Gemma 3 takes user and assistant messages after an optional first system message, "
    "not ' ~ m['role']) }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma 3 turns alternate user, assistant, user, ... (starting with user)') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first and system is not none %}{{ system }}\n\n{% endif %}"
    "{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
