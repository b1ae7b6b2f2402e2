"""Seeded workload generators: multi-turn chat, tool-using agents, and questions about shared documents.

A conversation is a list of segments (system prompt, user turns, replies, tool calls, tool
outputs); a segment's token ids are a pure function of its seed (`segment_tokens`), so a
request can be replayed live with real token ids, while the simulator only needs its block
content ids. Block ids are chained like kvledger's chain keys (an id depends on every token up
to the end of its block), at `block_tokens` granularity (128 = kvledger's block by default):
two requests share block k's id iff their first (k + 1) · block_tokens tokens are equal.

The generators are deterministic for a given config (seed included) and return a `Trace`
whose requests carry `segments`, `hash_ids` (the last may name a partial block) and
`output_hash_ids` (the full blocks a reply completes, which the next turn reuses).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from dataclasses import dataclass, replace

import numpy as np

from kvledger.bench.trace import TraceRequest, TraceSegment, Trace

VOCAB = 49_152  # SmolLM2's vocabulary: token ids are drawn from [0, VOCAB)
WORKLOADS = ("chat", "agent", "document")


def segment_tokens(seg: TraceSegment, vocab: int = VOCAB) -> np.ndarray:
    """The token ids of one segment (uint32), the same on every machine for the same seed."""
    return np.random.default_rng([seg.seed, 0x6B76]).integers(0, vocab, seg.length, dtype=np.uint32)


def sequence_tokens(r: TraceRequest, vocab: int = VOCAB) -> np.ndarray:
    """Prompt followed by output, as token ids (workload requests only: traces carry no output)."""
    if not r.segments:
        raise ValueError("this request has no segments (trace requests carry only block ids)")
    return np.concatenate([segment_tokens(s, vocab) for s in r.segments])


def prompt_tokens(r: TraceRequest, vocab: int = VOCAB, salt: int = 0) -> np.ndarray:
    """The prompt's token ids (uint32). A workload request spells them from its segments; a
    trace request gets block i's tokens from its hash id alone (equal ids → equal tokens, so a
    live replay reuses exactly the prefixes the trace reuses), and tokens past its last id from
    `salt` (pass something unique per request, e.g. its index)."""
    if r.segments:
        return sequence_tokens(r, vocab)[: r.input_length]
    bt, parts = r.block_tokens, []
    for i, h in enumerate(r.hash_ids):
        parts.append(np.random.default_rng([h & (2**63 - 1), 0x6B76]).integers(0, vocab, bt, dtype=np.uint32)
                     [: r.block_len(i)])
    rest = r.input_length - len(r.hash_ids) * bt
    if rest > 0:
        parts.append(np.random.default_rng([salt, 0x7A11]).integers(0, vocab, rest, dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


class BlockChain:
    """Chained block ids of a growing sequence of segments.

    Invariant: ids[k] = H(ids[k−1] ‖ the (seed, start, end) pieces of block k); full-block ids
    are computed once and kept, so a session's turns extend the chain incrementally."""

    def __init__(self, block_tokens: int, root: int = 0) -> None:
        assert block_tokens > 0
        self.bt = block_tokens
        self.root = root
        self.segments: list[TraceSegment] = []
        self.starts: list[int] = []
        self.total = 0
        self._full: list[int] = []

    def append(self, seg: TraceSegment) -> None:
        assert seg.length > 0
        self.segments.append(seg)
        self.starts.append(self.total)
        self.total += seg.length

    def _block_id(self, k: int, end: int) -> int:
        lo = k * self.bt
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<q", self._full[k - 1] if k else self.root))
        i = bisect.bisect_right(self.starts, lo) - 1
        while i < len(self.segments) and self.starts[i] < end:
            s0, seg = self.starts[i], self.segments[i]
            h.update(struct.pack("<qqq", seg.seed, max(lo, s0) - s0, min(end, s0 + seg.length) - s0))
            i += 1
        return int.from_bytes(h.digest(), "little") & (2**63 - 1)

    def ids(self, length: int) -> list[int]:
        """Ids of the blocks of the first `length` tokens: full blocks, then a partial one if any."""
        assert 0 <= length <= self.total
        full = length // self.bt
        while len(self._full) < full:
            k = len(self._full)
            self._full.append(self._block_id(k, (k + 1) * self.bt))
        out = self._full[:full]
        if length % self.bt:
            out.append(self._block_id(full, length))
        return out


@dataclass(frozen=True, slots=True)
class ChatConfig:
    """Multi-turn chat: sessions start as a Poisson process over `duration_s`; each picks one of
    a few shared system prompts; turns = 1 + geometric; a user turn waits for the reply
    (nominal `decode_tps`) plus a think time. Lengths in tokens, times in seconds."""

    seed: int = 0
    sessions: int = 1000
    duration_s: float = 1200.0
    system_prompts: int = 6
    system_tokens: tuple[int, int] = (300, 3000)
    turns_mean: float = 5.0
    user_tokens_median: float = 120.0
    reply_tokens_median: float = 350.0
    think_s: tuple[float, float] = (10.0, 120.0)
    decode_tps: float = 30.0
    block_tokens: int = 128


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Tool-using agents: a few apps, each with a long shared system prompt (instructions and
    tool definitions); a session is a task message, then steps of (tool call → tool output)
    that grow the history; a step waits for the call (nominal `decode_tps`) plus the tool."""

    seed: int = 0
    sessions: int = 200
    duration_s: float = 1200.0
    apps: int = 4
    system_tokens: tuple[int, int] = (6000, 16000)
    task_tokens_median: float = 400.0
    steps_mean: float = 12.0
    call_tokens: tuple[int, int] = (40, 300)
    tool_output_tokens_median: float = 1200.0
    tool_output_tokens_max: int = 8000
    tool_latency_s: tuple[float, float] = (0.5, 8.0)
    decode_tps: float = 30.0
    block_tokens: int = 128


@dataclass(frozen=True, slots=True)
class DocumentConfig:
    """Questions about shared documents (retrieval, a long file read in a chat): requests arrive as a Poisson
    process over `duration_s`, each one question, after one of a few documents (Zipf-like popularity), with no
    system prompt before it. Each prompt is the document, then its question; the documents' ends are the prefixes
    many prompts share and none ends at (rule 4″). Lengths in tokens, times in seconds."""

    seed: int = 0
    sessions: int = 2000          # questions (each its own one-turn session)
    duration_s: float = 1200.0
    documents: int = 20
    document_tokens: tuple[int, int] = (2000, 8000)
    question_tokens_median: float = 100.0
    reply_tokens_median: float = 250.0
    block_tokens: int = 128


def zipf_weights(n: int) -> np.ndarray:
    """Zipf-like popularity of `n` shared prefixes, the k-th (from 1) drawn with weight 1/k: a few dominate."""
    weights = 1.0 / np.arange(1, n + 1)
    return weights / weights.sum()


class _Gen:
    """Shared machinery: seeded draws, unique segment seeds, request assembly."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self._next_seed = (seed & 0xFFFF) << 40

    def seg(self, length: int) -> TraceSegment:
        self._next_seed += 1
        return TraceSegment(self._next_seed, max(int(length), 1))

    def lognormal(self, median: float, sigma: float = 0.8, cap: int = 1 << 20) -> int:
        return int(min(max(self.rng.lognormal(np.log(median), sigma), 1), cap))

    def uniform(self, lo_hi: tuple[float, float]) -> float:
        return float(self.rng.uniform(*lo_hi))

    @staticmethod
    def request(t: float, chain: BlockChain, reply: TraceSegment, ttl_class: str, session: int) -> TraceRequest:
        """The request whose prompt is the chain so far and whose output is `reply` (appended)."""
        length = chain.total
        chain.append(reply)
        ids = chain.ids(chain.total)
        bt = chain.bt
        first_out, last_out = length // bt, chain.total // bt
        return TraceRequest(t, length, reply.length, tuple(chain.ids(length)), bt, tuple(ids[first_out:last_out]),
                       ttl_class, session, tuple(chain.segments))


def chat(cfg: ChatConfig = ChatConfig()) -> Trace:
    g = _Gen(cfg.seed)
    systems = [g.seg(g.rng.integers(*cfg.system_tokens)) for _ in range(cfg.system_prompts)]
    popularity = zipf_weights(cfg.system_prompts)
    starts = np.sort(g.rng.uniform(0, cfg.duration_s, cfg.sessions))
    requests: list[TraceRequest] = []
    for s, t in enumerate(starts):
        chain = BlockChain(cfg.block_tokens)
        chain.append(systems[g.rng.choice(cfg.system_prompts, p=popularity)])
        turns = int(g.rng.geometric(1.0 / cfg.turns_mean))  # >= 1, mean turns_mean
        for _ in range(turns):
            chain.append(g.seg(g.lognormal(cfg.user_tokens_median)))
            reply = g.seg(g.lognormal(cfg.reply_tokens_median, cap=4000))
            requests.append(g.request(float(t), chain, reply, "chatbot", s))
            t += 1.0 + reply.length / cfg.decode_tps + g.uniform(cfg.think_s)
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), f"workload:chat seed={cfg.seed} sessions={cfg.sessions}")


def agent(cfg: AgentConfig = AgentConfig()) -> Trace:
    g = _Gen(cfg.seed)
    systems = [g.seg(g.rng.integers(*cfg.system_tokens)) for _ in range(cfg.apps)]
    starts = np.sort(g.rng.uniform(0, cfg.duration_s, cfg.sessions))
    requests: list[TraceRequest] = []
    for s, t in enumerate(starts):
        chain = BlockChain(cfg.block_tokens)
        chain.append(systems[int(g.rng.integers(cfg.apps))])
        chain.append(g.seg(g.lognormal(cfg.task_tokens_median)))
        steps = int(g.rng.geometric(1.0 / cfg.steps_mean))
        for _ in range(steps):
            call = g.seg(g.rng.integers(*cfg.call_tokens))
            requests.append(g.request(float(t), chain, call, "agent", s))
            chain.append(g.seg(g.lognormal(cfg.tool_output_tokens_median, 1.0, cfg.tool_output_tokens_max)))
            t += 0.5 + call.length / cfg.decode_tps + g.uniform(cfg.tool_latency_s)
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), f"workload:agent seed={cfg.seed} sessions={cfg.sessions}")


def document(cfg: DocumentConfig = DocumentConfig()) -> Trace:
    g = _Gen(cfg.seed)
    docs = [g.seg(g.rng.integers(*cfg.document_tokens)) for _ in range(cfg.documents)]
    popularity = zipf_weights(cfg.documents)
    requests: list[TraceRequest] = []
    for s, t in enumerate(np.sort(g.rng.uniform(0, cfg.duration_s, cfg.sessions))):
        chain = BlockChain(cfg.block_tokens)
        chain.append(docs[g.rng.choice(cfg.documents, p=popularity)])
        chain.append(g.seg(g.lognormal(cfg.question_tokens_median)))
        requests.append(g.request(float(t), chain, g.seg(g.lognormal(cfg.reply_tokens_median, cap=4000)),
                                  "chatbot", s))
    return Trace(tuple(requests), f"workload:document seed={cfg.seed} sessions={cfg.sessions}")


MAX_SESSIONS = 100_000  # 100× the chat default; a simulation of more would not fit in memory


def generate(name: str, seed: int = 0, sessions: int | None = None, block_tokens: int = 128) -> Trace:
    """`chat`, `agent` or `document` with its defaults, a seed, and optionally a number of sessions."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if sessions is not None and not 1 <= sessions <= MAX_SESSIONS:
        raise ValueError(f"sessions must lie in [1, {MAX_SESSIONS:,}], got {sessions:,}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    make, cfg = {"chat": (chat, ChatConfig()), "agent": (agent, AgentConfig()),
                 "document": (document, DocumentConfig())}[name]
    more = {} if sessions is None else {"sessions": sessions}
    return make(replace(cfg, seed=seed, block_tokens=block_tokens, **more))
