"""A chat on the engine: the model's chat template, CHECK, generation, and what each turn reused.

    chat = Chat(engine, ledger, registry.resolve(name))   # the model's entry: its tokenizer and chat template
    turn = chat.say("What is a KV cache?")                # Turn(reply, prompt_tokens, cached_tokens, ttft_s, ...)

The template is the model's (`ChatTemplate`, rendered as Hugging Face does); the history keeps each
reply as generated, so the next turn's prompt starts with the previous prompt and reply and hits
the blocks the decode wrote (rule 7).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from kvledger.engine.api import EngineRequest, SamplingParams
from kvledger.entrypoint.check import check_prompt

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Turn:
    reply: str               # as generated (not stripped: the next prompt must re-tokenize to the same ids)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_kind: str
    ttft_s: float            # CHECK start → first token
    timings: dict[str, float]


class Chat:
    def __init__(self, engine: Any, block_ledger: Any, model: Any, *, state_ledger: Any = None,
                 namespace: str = "default", max_tokens: int = 64) -> None:
        self.engine, self.block_ledger, self.state_ledger = engine, block_ledger, state_ledger
        self.namespace, self.max_tokens = namespace, max_tokens
        self.messages: list[dict[str, str]] = []
        self._tokenizer, self._template = model.text()   # `model`: a registry.ModelEntry with a chat template
        assert self._template is not None, f"{model.name} has no chat template"

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self._template.tokenize(messages)

    def run(self, tokens: list[int], max_tokens: int, namespace: str | None = None) -> tuple[list[int], Turn]:
        """One generation (greedy) for `tokens`; the tokens produced and the turn's figures."""
        ns = namespace or self.namespace
        t0 = time.perf_counter()
        keys, decision = check_prompt(tokens, self.engine.spec, block_ledger=self.block_ledger,
                                      state_ledger=self.state_ledger, namespace=ns)
        rid = f"chat-{next(_ids)}"
        self.engine.add_request(EngineRequest(rid, tokens, keys, decision, SamplingParams(max_tokens=max_tokens),
                                              namespace=ns))
        out: list[int] = []
        ttft, usage = None, None
        while self.engine.has_unfinished():
            for event in self.engine.step():
                if ttft is None and event.token_ids:
                    ttft = time.perf_counter() - t0
                out += event.token_ids
                usage = event.usage or usage
        self.engine.wait_stored()
        text = self._tokenizer.decode([t for t in out if t not in self.engine.eos_token_ids])
        return out, Turn(text, len(tokens), usage.cached_tokens, usage.completion_tokens, usage.hit_kind,
                         ttft or 0.0, dict(usage.timings))

    def say(self, text: str) -> Turn:
        self.messages.append({"role": "user", "content": text})
        _, turn = self.run(self.prompt_ids(self.messages), self.max_tokens)
        self.messages.append({"role": "assistant", "content": turn.reply})
        return turn
