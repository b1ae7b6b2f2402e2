"""The HTTP request and response models of `kvledger serve` (OpenAI's shapes, pydantic).

Requests are validated strictly (no "5" for 5, no 1.0 or true for 1): a wrong type is a 400 with
OpenAI's error object, never a 5xx. Fields that vLLM's and SGLang's benchmark clients send are accepted
(`ignore_eos`, `top_k`, `repetition_penalty`, `cache_salt`, ...); unknown fields are ignored,
as vLLM does. Fields that would change the answer's shape and are not supported yet (`tools`,
`tool_choice`, `response_format`) are refused with a 400 unless harmless (`refuse_unsupported`), never
silently ignored. Lengths are in tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator,
                      model_validator)
from pydantic_core import PydanticCustomError

from kvledger.entrypoint.errors import bad_request

UNSUPPORTED = "unsupported_parameter"   # the error code of a field refused until it is supported

TokenIds = Annotated[list[int], Field(min_length=1)]   # the range is the vocabulary's (prepare.token_ids)
PROMPT_SHAPES = "a string, a list of token ids, or a list of one of either"


def _one_shape(value: Any, handler: Any) -> Any:
    """One error naming the shapes a prompt may take, for pydantic's one per union member (whose first,
    "prompt.str: Input should be a valid string", answered a list of ids)."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("prompt_shape", f"Input should be {PROMPT_SHAPES}") from None


def _only_false(value: bool) -> bool:
    if value:
        raise ValueError("not supported (send false)")
    return value


# one prompt: a string, token ids, or a batch of one of either (the openai client sends those shapes)
PromptInput = Annotated[str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)]
                        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)], WrapValidator(_one_shape)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """What both endpoints share. `n` must be 1; `logprobs` is accepted only as null/false/0."""

    model: str = Field(min_length=1, max_length=256)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None          # -1 or 0: off
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None   # 1e-40 overflowed logits
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    explain_cache_miss: bool = False   # kvledger's: usage.kvledger.miss says why the prompt's tokens missed
    store: bool | None = None   # false: a no-store request (DESIGN rule 12; OpenAI's field of the same name);
                                # the header `Cache-Control: no-store` says the same (prepare.may_store)
    logprobs: Any = None
    response_format: Any = None   # only null or {"type": "text"} (refuse_unsupported)

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported (send null)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise ValueError(f"{name} is not supported (send 0 or null); use repetition_penalty")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `max_tokens` defaults to 16, as OpenAI's (less if the context or the
    server's limit leaves less)."""

    prompt: PromptInput
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    echo: Annotated[bool, AfterValidator(_only_false)] = False
    suffix: None = None

    def prompt_one(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=256)] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Any = None             # only null or []: no tool parser yet (refuse_unsupported)
    tool_choice: Any = None       # only null or "none"

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class LegDetails(BaseModel):
    """One engine leg of a cluster request: `start` output tokens came before it (engine.api.Leg); what it reused
    of the tokens it was given (prompt + output so far) and what it ran through the model, once it reported."""

    kind: str
    engine: str
    start: int
    cached_tokens: int | None = None
    computed_prompt_tokens: int | None = None


class CacheDetails(BaseModel):
    """kvledger's own usage field: where the cached prompt tokens came from.
    device_cached_tokens + store_cached_tokens = prompt_cache_hit_tokens; computed_prompt_tokens are the
    prompt positions the serving engine ran through the model (= the miss for an exact hit)."""

    hit_kind: str                 # core.HitKind value actually used ("snapshot", "fallback", "full", "miss", ...)
    device_cached_tokens: int     # found in the serving engine's own device prefix cache
    store_cached_tokens: int      # read from the block ledger (and the state ledger)
    computed_prompt_tokens: int | None = None   # None when no engine reported (the request failed first)
    engine: str | None = None     # the engine that served the prompt (cluster mode)
    legs: list[LegDetails] | None = None   # cluster mode: the engine legs, in order
    miss: dict[str, Any] | None = None     # with explain_cache_miss only: miss tokens by cause, the divergence
    stored: bool | None = None             # False on a no-store request (nothing of it was kept); absent otherwise


class Usage(BaseModel):
    """OpenAI's usage plus DeepSeek's names: hit + miss = prompt_tokens; cached_tokens = hit."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kvledger: CacheDetails | None = None

    @classmethod
    def of(cls, prompt: int, cached: int, completion: int, *, hit_kind: str = "miss", device_cached: int = 0,
           computed: int | None = None, engine: str | None = None, legs: list[LegDetails] | None = None,
           miss: dict[str, Any] | None = None, stored: bool = True) -> Usage:
        assert 0 <= device_cached <= cached <= prompt
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_cache_hit_tokens=cached, prompt_cache_miss_tokens=prompt - cached,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                   kvledger=CacheDetails(hit_kind=hit_kind, device_cached_tokens=device_cached,
                                         store_cached_tokens=cached - device_cached, computed_prompt_tokens=computed,
                                         engine=engine, legs=legs, miss=miss, stored=None if stored else False))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvledger"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class DiffRequest(_Request):
    """POST /dashboard/diff: two prompts as text (tokenized) or token ids."""

    a: Annotated[str, Field(max_length=1_000_000)] | TokenIds
    b: Annotated[str, Field(max_length=1_000_000)] | TokenIds


class PublicPrefixChange(_Request):
    """POST /admin/public-prefixes (operator): prefixes to publish and to withdraw, each token ids or a string
    tokenized as a prompt's start (entrypoint/public_prefix.py)."""

    add: Annotated[list[Annotated[str, Field(max_length=1_000_000)] | TokenIds], Field(max_length=64)] = []
    remove: Annotated[list[Annotated[str, Field(max_length=1_000_000)] | TokenIds], Field(max_length=64)] = []


class ForgetRequest(_Request):
    """POST /admin/forget: the tenant to forget (its namespace as --api-keys names it) and how long after its writes
    are held, in seconds (default `store.forget.DEFAULT_HOLD_S`; 0: none)."""

    namespace: Annotated[str, Field(max_length=1024)]
    hold_s: float | None = None


def refuse_unsupported(body: SamplingFields) -> None:
    """A 400 naming the field for what the server cannot honour yet, as vLLM does without a tool
    parser: tools and a tool choice that asks for calls, and a response format other than text.
    The harmless values pass: `tools` null or [], `tool_choice` null or "none", `response_format`
    null or {"type": "text"}."""
    if isinstance(body, ChatCompletionRequest):
        if body.tools not in (None, []):
            raise bad_request("tools are not supported yet (this server has no tool-call parser); send null or [].",
                              "tools", UNSUPPORTED)
        if body.tool_choice not in (None, "none"):
            raise bad_request('tool_choice is not supported yet (no tool-call parser); send null or "none".',
                              "tool_choice", UNSUPPORTED)
    if body.response_format not in (None, {"type": "text"}):
        raise bad_request('response_format is not supported yet (no structured output); send null or '
                          '{"type": "text"}.', "response_format", UNSUPPORTED)
