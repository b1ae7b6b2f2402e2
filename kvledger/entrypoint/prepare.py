"""A validated HTTP request → the engine's request: tokenize, check limits, CHECK (rule 5).

Order: model name, prompt text too long to fit (by its bytes), prompt tokens (chat template applied),
length limits, sampling, namespace (the tenant's, split by `cache_salt`), then CHECK: chain keys +
the index + the directory's snapshot at L1 + `decide_hit` — all before the engine sees the request,
from metadata alone. Tokenizing and CHECK run in worker threads, never on the event loop.

Whether the request may be stored (DESIGN rule 12) is decided here, once (`may_store`), and travels with it as
`EngineRequest.store`: the engine, the miss sample and the trace read that flag and decide nothing of their own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import numpy as np

from kvledger.core import (HitDecision, HitLookup, blocks_spanned, cap_blocks, decide_hit, message_snapshot_indices,
                           salted_namespace, shared_prefix_positions)
from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.entrypoint.auth import Tenant
from kvledger.engine.models.chat_template import ChatTemplateError
from kvledger.entrypoint.check import check_prompt_explained
from kvledger.entrypoint.errors import ApiError, bad_request, model_not_found
from kvledger.store.backend import Match
from kvledger.entrypoint.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, refuse_unsupported
from kvledger.entrypoint.server_state import ServerState
from kvledger.engine.models.tokenizer import encode_ids

DEFAULT_TEMPERATURE = 1.0   # OpenAI's default; send 0 for greedy
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
GREEDY_BELOW = 1e-5         # a temperature this small samples as greedy (dividing logits by it would overflow)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the engine. `arrival` is time.perf_counter() at receipt (seconds)."""

    engine_request: EngineRequest
    endpoint: str                   # "chat" | "completion"
    tenant: Tenant
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    arrival: float
    absent_blocks: int              # blocks under the hit cap the index did not hold
    found: Match | None = None      # the index's answer at the CHECK (blocks present, the first absent one's
                                    # tombstone); None under --no-cache
    explain_miss: bool = False      # the client asked for usage.kvledger.miss

    @property
    def stores(self) -> bool:
        """Whether anything of the request may stay (blocks, snapshots, the miss sample, the trace): `may_store`."""
        return self.engine_request.store

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.engine_request.tokens)

    @property
    def decision(self) -> HitDecision:
        return self.engine_request.decision


async def prepare(state: ServerState, tenant: Tenant, body: SamplingFields, endpoint: str,
                  cache_control: str | None = None) -> Prepared:
    """`cache_control`: the request's `Cache-Control` header, if any (`may_store`)."""
    arrival = time.perf_counter()
    if body.model != state.model:
        raise model_not_found(body.model, state.model)
    refuse_unsupported(body)
    if state.max_model_len == 0:   # cluster mode: no engine has registered yet
        raise ApiError(503, "No engine serves this model yet; retry in a few seconds.", "server_error",
                       code="no_engine")
    refuse_oversized_text(state, body)
    tokens = await asyncio.to_thread(prompt_tokens, state, body)
    sampling = sampling_params(state, body, len(tokens))
    namespace = salted_namespace(tenant.namespace, body.cache_salt)
    public = 0 if state.config.no_cache else state.public.blocks(tokens)   # rule 12: a published prefix's blocks
    keys, lookup, found = await asyncio.to_thread(_check, state, tokens, namespace, tenant.ttl_class, public)
    decision = lookup.decision
    shared: tuple[int, ...] = ()   # rule 4″: where the prefill also snapshots
    if state.spec.has_swa and not state.config.no_cache:
        chat = isinstance(body, ChatCompletionRequest) and len(body.messages) > 1
        ends = await asyncio.to_thread(message_ends, state, body, tokens) if chat else ()
        shared = shared_prefix_positions(lookup, state.spec, ends)
    most = cap_blocks(len(tokens), state.spec)
    absent = most - min(blocks_spanned(lookup.l1, state.spec), most)   # a window missing is not a block absent
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    req = EngineRequest(f"{prefix}-{uuid.uuid4().hex}", tokens, keys, decision, sampling, namespace,
                        tenant.ttl_class, public_blocks=public, snapshot_at=shared,
                        store=may_store(tenant, body, cache_control, held=state.forgetting.holds(namespace)))
    return Prepared(req, endpoint, tenant, body.stop_strings, body.stream, body.include_usage, arrival,
                    absent if not state.config.no_cache else 0, found, body.explain_cache_miss)


def may_store(tenant: Tenant, body: SamplingFields, cache_control: str | None, *, held: bool = False) -> bool:
    """Whether the request may be stored (DESIGN rule 12): not when its key says `"store": false`, its body
    `"store": false`, its header `Cache-Control` carries the directive `no-store` (RFC 9111 §5.2.1.5: no cache
    keeps any part of the request; directives are comma-separated and case-insensitive, `no-store` takes no
    argument), or its tenant is `held` (forgotten moments ago: forget.py). Any one is enough; `"store": true`
    overrides none of the others.

        may_store(Tenant("a"), body, "no-cache, No-Store")   → False
        may_store(Tenant("a"), body, "max-age=0")            → True (with the body's store absent or true)"""
    if not tenant.store or body.store is False or held:
        return False
    if cache_control is None:
        return True
    directives = (part.split("=", 1)[0].strip().lower() for part in cache_control.split(","))
    return "no-store" not in directives


def _check(state: ServerState, tokens: np.ndarray, namespace: str, ttl_class: str | None, public_blocks: int
           ) -> tuple[list[bytes], HitLookup, Match | None]:
    """The CHECK, with the index's answer: the first absent block's tombstone comes in the same round trip, and
    the rest of its cause (the sample: entrypoint/misses.py) is looked up once the request is done, off the
    CHECK's path."""
    if state.config.no_cache:   # the baseline: nothing is looked up, every prompt is computed
        from kvledger.core import chain_keys

        miss = HitLookup(decide_hit(len(tokens), 0, set(), state.spec), 0)
        return chain_keys(tokens, state.spec, namespace), miss, None
    return check_prompt_explained(tokens, state.spec, block_ledger=state.block_ledger,
                                  state_ledger=state.state_ledger, namespace=namespace, ttl_class=ttl_class,
                                  replay=state.config.replay, public_blocks=public_blocks)


def refuse_oversized_text(state: ServerState, body: SamplingFields) -> None:
    """A 400 before any tokenizing for prompt text that cannot fit: no token spells more than
    `state.max_token_bytes` bytes, so text over the prompt token limit × that many bytes has too many tokens.
    Text that is not valid Unicode (a lone surrogate, which JSON can carry) is a 400 here too."""
    chat = isinstance(body, ChatCompletionRequest)
    prompt = None if chat else body.prompt_one()
    if state.tokenizer is None or isinstance(prompt, list):
        return
    param = "messages" if chat else "prompt"
    size = sum(utf8_bytes(m.text(), param) for m in body.messages) if chat else utf8_bytes(prompt, param)
    cap = prompt_token_limit(state)
    most = cap * state.max_token_bytes
    if size > most:
        code = "context_length_exceeded" if cap == state.max_model_len - 1 else "prompt_too_long"
        raise ApiError(400, f"The prompt has {size} bytes of text; this server takes at most {cap} tokens, so at "
                       f"most {most} bytes ({state.max_token_bytes} per token, its longest).", param=param, code=code)


def utf8_bytes(text: str, param: str) -> int:
    """The text's UTF-8 length; a 400 naming `param` for text that has none (a lone surrogate)."""
    try:
        return len(text.encode())
    except UnicodeEncodeError as e:
        raise bad_request(f"{param}: the text is not valid Unicode (a lone surrogate at character {e.start})", param,
                          "invalid_value") from None


def prompt_token_limit(state: ServerState) -> int:
    """The most prompt tokens a request may have: `--max-prompt-tokens`, and one short of the context."""
    cap = state.config.max_prompt_tokens
    return state.max_model_len - 1 if cap is None else min(cap, state.max_model_len - 1)


def prompt_tokens(state: ServerState, body: SamplingFields) -> np.ndarray:
    """The prompt's token ids (seconds for a long text: call it off the event loop)."""
    return chat_tokens(state, body) if isinstance(body, ChatCompletionRequest) else completion_tokens(state, body)


def completion_tokens(state: ServerState, body: CompletionRequest) -> np.ndarray:
    prompt = body.prompt_one()
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise bad_request(f"{state.model} has no tokenizer: send the prompt as a list of token ids", "prompt")
        return _nonempty(np.asarray(encode_ids(state.tokenizer, prompt), dtype=np.uint32), "prompt")
    return _nonempty(token_ids(prompt, state.vocab_size, "prompt"), "prompt")


def token_ids(ids: list[int], vocab_size: int, param: str) -> np.ndarray:
    """`ids` as uint32, each checked in [0, vocab_size) first: a 400 naming the first outside."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}: token ids must be in [0, {vocab_size}), the vocabulary; {bad} is not", param,
                          "invalid_token_id")
    return np.asarray(ids, dtype=np.uint32)


def chat_tokens(state: ServerState, body: ChatCompletionRequest) -> np.ndarray:
    if state.chat_template is None or state.tokenizer is None:
        raise bad_request(f"{state.model} has no chat template: use /v1/completions with token ids", "messages")
    try:
        ids = state.chat_template.tokenize(template_messages(body))
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    return _nonempty(np.asarray(ids, dtype=np.uint32), "messages")


def message_ends(state: ServerState, body: ChatCompletionRequest, tokens: np.ndarray) -> tuple[int, ...]:
    """Rule 4″ (b): where a chat's first message (a system prompt) and its latest earlier message end in `tokens`
    (its prompt), at most `core.MESSAGE_SNAPSHOTS` of them (a re-encoding of those messages: call it off the event
    loop)."""
    assert state.chat_template is not None
    which = message_snapshot_indices(len(body.messages))
    return state.chat_template.message_ends(template_messages(body), tokens.tolist(), which)


def template_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template reads them: role and plain text."""
    return [{"role": m.role, "content": m.text()} for m in body.messages]


def _nonempty(tokens: np.ndarray, param: str) -> np.ndarray:
    if tokens.size == 0:
        raise bad_request("The prompt is empty: send at least one token.", param, "empty_prompt")
    return tokens


def sampling_params(state: ServerState, body: SamplingFields, prompt_len: int) -> SamplingParams:
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    cap = state.config.max_prompt_tokens
    if cap is not None and prompt_len > cap:
        raise ApiError(400, f"The prompt has {prompt_len} tokens; this server takes at most {cap}.", param=param,
                       code="prompt_too_long")
    room = state.max_model_len - prompt_len
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens; the prompt has "
                       f"{prompt_len} (at least one token must be left to generate).", param=param,
                       code="context_length_exceeded")
    chat = isinstance(body, ChatCompletionRequest)
    limit = body.output_limit if chat else body.max_tokens
    most = state.config.max_tokens_limit
    if limit is None:
        limit = min(state.config.default_max_tokens if chat else COMPLETION_MAX_TOKENS, room, most or room)
    if most is not None and limit > most:
        raise bad_request(f"max_tokens is {limit}; this server generates at most {most} tokens per request.",
                          "max_tokens", "max_tokens_too_large")
    if limit > room:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens; you requested "
                       f"{prompt_len + limit} ({prompt_len} in the prompt, {limit} to generate).",
                       param="max_tokens", code="context_length_exceeded")
    stop_ids = tuple(body.stop_token_ids or ())
    if any(t >= state.vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must lie in [0, {state.vocab_size})", "stop_token_ids",
                          "invalid_token_id")
    if chat and state.chat_template is not None:   # the turn format's end of turn (Gemma's <end_of_turn>)
        stop_ids += tuple(t for t in state.chat_template.stop_token_ids if t not in stop_ids)
    try:
        temperature = _or(body.temperature, DEFAULT_TEMPERATURE)
        return SamplingParams(max_tokens=limit, temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
                              top_p=_or(body.top_p, 1.0), top_k=max(_or(body.top_k, 0), 0),
                              repetition_penalty=_or(body.repetition_penalty, 1.0), stop_token_ids=stop_ids,
                              ignore_eos=body.ignore_eos, seed=body.seed)
    except ValueError as e:
        raise bad_request(str(e)) from None


def _or(value, default):
    return default if value is None else value
