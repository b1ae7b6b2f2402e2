"""The operator page's data: the last requests, the hit series, and the prompt diff form.

Cumulative figures (tokens, hit rate, TTFT, store size) are read by the page from `/metrics`
itself; this module serves only what Prometheus does not keep.
"""

from __future__ import annotations

from typing import Any

from kvledger.core import diff_prompts
from kvledger.entrypoint.errors import bad_request
from kvledger.entrypoint.prepare import token_ids
from kvledger.entrypoint.protocol import DiffRequest
from kvledger.entrypoint.server_state import ServerState
from kvledger.engine.models.tokenizer import encode_ids
from kvledger.util.render import diff_json


def activity(state: ServerState) -> dict[str, Any]:
    return {"model": state.model, "block_size": state.spec.block_size, "no_cache": state.config.no_cache,
            **state.activity.as_json()}


def diff(state: ServerState, body: DiffRequest) -> dict[str, Any]:
    """`kvledger diff` on two prompts: where they diverge and how many blocks of B would hit after A."""
    a, b = _tokens(state, body.a, "a"), _tokens(state, body.b, "b")
    decode = None
    if state.tokenizer is not None:
        def decode(ids: list[int]) -> str:
            return state.tokenizer.decode(list(ids), skip_special_tokens=False)
    return diff_json(diff_prompts(a, b, state.spec), a, b, state.spec.name, decode)


def _tokens(state: ServerState, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise bad_request(f"{state.model} has no tokenizer: give token ids", param)
        return encode_ids(state.tokenizer, prompt)
    return token_ids(prompt, state.vocab_size, param).tolist()
