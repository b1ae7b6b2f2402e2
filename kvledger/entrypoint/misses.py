"""Why prompts miss, live: the recent prompts each namespace sent, the cause of each miss, the divergence sites.

    book = MissBook(block_size=128)
    first = book.first_absent(namespace, tokens, keys, blocks, gone)   # the first absent block's cause
    book.account(namespace, split, first, tokens)                      # its tokens by cause (core.attribution)
    book.add(namespace, tokens, keys)                                  # the prompt joins its namespace's sample

`blocks` and `gone` are what the CHECK's index lookup answered (`store.backend.Match`: the tombstone comes in the
same round trip); the sample is consulted when the request is done, so the CHECK pays nothing for it.

The sample. Per namespace (salted namespaces apart: they share no block), the most recent prompts' token ids,
in memory only (never persisted, never shown outside the tenant), at most `max_prompts` prompts and
`max_tokens` tokens each namespace. A tenant (`core.tenant_of`: an API key's namespace; the open server is
one tenant) pays for all its namespaces, its salted ones included, out of its own budget, `max_total_tokens`
/ `tenants`, each prompt costing its tokens + PROMPT_COST; beyond it the tenant's least recently used
namespace gives way first, never another tenant's. So no tenant's traffic moves another's sample (a cause
never flips because of someone else's prompts, so it cannot reveal them), ten thousand salts of one key get
the budget of one key, and the whole sample costs at most `max_total_tokens`: the server passes the number
of tenants its key file names (`auth.tenant_count`, 1 when open), and a tenant beyond that number is not
sampled (its misses are `cold`). The charge is close, not exact: a 1,000-token prompt holds 4 KB of ids, is
charged 1,384 tokens (5.5 KB) and measured 7.3 KB with its trie entries. The prompts are indexed by chain key
as a trie of blocks: a block's key → the blocks that followed it in some sampled prompt (`ROOT` → the first
blocks), each child remembered by its key and the latest prompt that has it. So the nearest sampled prompt
of a missing one is found in O(its blocks): the children of its last present block are the only candidates
for its first absent one.

The first absent block's cause (core.attribution): a tombstone the index kept (expired, evicted), else
`diverged` at the first token t where the prompt differs from a sampled prompt that went on past t inside that
block (in the first block, only after MIN_SHARED common tokens), else `cold` (nothing sampled continued there:
first seen, or a prompt that extends what was cached, as a conversation's next turn does).

The divergence sites, per tenant: where prompts diverge (token position), how often, the tokens lost after
them, and an example: the differing spans of the prompt and of the sampled one it diverged from, and how many
more blocks would hit with the varying span moved to the end (the answer of `kvledger diff`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvledger.core import tenant_of
from kvledger.core.attribution import MissCause, MissSplit
from kvledger.store.backend import Gone

ROOT = b""                    # the parent of every first block in the trie
MAX_PROMPTS = 256             # per namespace
MAX_TOKENS = 1 << 20          # per namespace: 4 MiB of uint32 token ids
MAX_TOTAL_TOKENS = 8 << 20    # over every tenant, each an equal share: 32 MiB of ids
PROMPT_COST = 384             # what a prompt costs its tenant beyond its tokens, in 4-byte tokens: its fixed objects
                              # (measured 1.3 KiB for one token in a namespace of its own)
MAX_SITES = 64                # divergence sites kept per tenant (the smallest by tokens lost give way)
SPAN_TOKENS = 24              # at most this many tokens of a differing span are shown (decoded)
MIN_SHARED = 32               # a prompt diverged in its first block only if it shared this many leading tokens,
                              # or most of the block position by position (a same-length edit: a timestamp, an
                              # id); a chat template's few fixed tokens do not make two prompts related


@dataclass(slots=True)
class _Prompt:
    tokens: np.ndarray        # uint32
    keys: list[bytes]         # chain keys of its full blocks


@dataclass(slots=True)
class _Namespace:
    prompts: OrderedDict[int, _Prompt] = field(default_factory=OrderedDict)   # oldest first
    children: dict[bytes, dict[bytes, int]] = field(default_factory=dict)      # parent → child key → prompt id
    tokens: int = 0


@dataclass(slots=True)
class _Sample:
    """One tenant's sample: its namespaces, least recently used first, and what their prompts cost
    (tokens + PROMPT_COST each; at most the tenant's budget once `add` returns)."""

    spaces: OrderedDict[str, _Namespace] = field(default_factory=OrderedDict)
    cost: int = 0


@dataclass(frozen=True, slots=True)
class FirstAbsent:
    """The first absent block of a prompt at its CHECK, and why it is absent."""

    block: int                                  # its index (the CHECK's leading present blocks)
    start: int                                  # its first token (L1 = block · B)
    cause: MissCause                            # one of core.attribution.BLOCK_CAUSES
    divergence: int | None = None               # token index (diverged only; may lie past `start`: blocks the
                                                # sample holds that the index does not yet)
    other: np.ndarray | None = field(default=None, repr=False)   # the sampled prompt it diverged from
    diverged_block: int | None = None           # the first token of the block the divergence lies in
    gone_at: float | None = None                # the tombstone's time (expired, evicted)


@dataclass(slots=True)
class Site:
    """One divergence position of a tenant's prompts."""

    position: int
    requests: int = 0
    tokens_lost: int = 0          # miss tokens of the diverged requests, beyond the position's block
    blocks_won: int = 0           # of the latest example: blocks that would hit with the span moved to the end
    example: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Tenant:
    requests: int = 0
    prompt_tokens: int = 0
    miss_tokens: dict[str, int] = field(default_factory=dict)
    sites: dict[int, Site] = field(default_factory=dict)


class MissBook:
    """The sample, the causes and the sites of one server (thread-safe: CHECKs run in worker threads)."""

    def __init__(self, block_size: int, *, tenants: int = 1, max_prompts: int = MAX_PROMPTS,
                 max_tokens: int = MAX_TOKENS, max_total_tokens: int = MAX_TOTAL_TOKENS,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        """`tenants`: how many tenants may be sampled (the key file's namespaces; 1 for an open server), each
        with a budget of `max_total_tokens // tenants` (module docstring)."""
        assert block_size > 0 and max_prompts > 0 and 0 < max_tokens <= max_total_tokens and tenants > 0
        self.b = block_size
        self.max_prompts, self.max_tokens, self.max_total_tokens = max_prompts, max_tokens, max_total_tokens
        self.tenants, self.tenant_budget = tenants, max_total_tokens // tenants
        self.decode = decode
        self._samples: dict[str, _Sample] = {}   # by tenant; at most `tenants`
        self._tenants: dict[str, _Tenant] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    # --- the CHECK ---------------------------------------------------------------------

    def first_absent(self, namespace: str, tokens: np.ndarray, keys: list[bytes], blocks: int,
                     gone: Gone | None) -> FirstAbsent:
        """The cause of block `blocks` of the prompt (the first one the index does not hold)."""
        if gone is not None:
            cause = MissCause.EXPIRED if gone.cause == "expired" else MissCause.EVICTED
            return FirstAbsent(blocks, blocks * self.b, cause, gone_at=gone.at)
        t, other, alike = self._nearest(namespace, tokens, keys, blocks)
        related = t >= MIN_SHARED or alike >= 0.5
        if other is not None and related and t < len(tokens) and len(other) > t:   # both go on past t, apart
            return FirstAbsent(blocks, blocks * self.b, MissCause.DIVERGED, t, other, t // self.b * self.b)
        return FirstAbsent(blocks, blocks * self.b, MissCause.COLD)

    def _nearest(self, namespace: str, tokens: np.ndarray, keys: list[bytes], blocks: int
                 ) -> tuple[int, np.ndarray | None, float]:
        """(t, prompt, alike): among the sampled prompts that share the first `blocks` blocks of `tokens`, the one
        agreeing with it on most positions of the next block (a same-length edit agrees everywhere else; a
        longer common prefix followed by shifted text does not), where the two first differ (t >= blocks · B),
        and the share of the block where they agree; (0, None, 0) when none. Blocks the sample holds past
        the index's (written moments ago, or still being written) are followed down the trie."""
        b = self.b
        with self._lock:
            space = self._space(namespace)
            if space is None or blocks > len(keys):
                return 0, None, 0.0
            parent = keys[blocks - 1] if blocks else ROOT
            while blocks < len(keys) and keys[blocks] in space.children.get(parent, {}):
                parent, blocks = keys[blocks], blocks + 1
            ids = list(space.children.get(parent, {}).values())
            others = [space.prompts[i].tokens for i in ids]
        start = blocks * b
        mine = np.asarray(tokens[start:start + b], dtype=np.uint32)
        best, best_t, best_same = None, start, -1
        for other in others:   # the nearest: most tokens of the block in common, position by position
            theirs = other[start:start + b]
            n = min(len(mine), len(theirs))
            differ = np.flatnonzero(mine[:n] != theirs[:n])
            same = n - differ.size
            if same > best_same:
                best, best_t, best_same = other, start + (int(differ[0]) if differ.size else n), same
        return best_t, best, max(best_same, 0) / max(min(len(mine), b), 1)

    def add(self, namespace: str, tokens: np.ndarray, keys: list[bytes]) -> None:
        """The prompt joins its namespace's sample; beyond the caps the oldest prompts of that namespace, then
        those of its tenant's least recently used namespaces, give way (never another tenant's)."""
        tokens = np.array(tokens, dtype=np.uint32)   # a copy: the caller's array lives on in the engine
        if len(tokens) > self.max_tokens or len(tokens) + PROMPT_COST > self.tenant_budget:
            return
        with self._lock:
            sample = self._sample_of(tenant_of(namespace))
            if sample is None:
                return
            space = sample.spaces.pop(namespace, None) or _Namespace()
            sample.spaces[namespace] = space   # most recently used
            pid, self._next_id = self._next_id, self._next_id + 1
            space.prompts[pid] = _Prompt(tokens, list(keys))
            space.tokens += len(tokens)
            sample.cost += len(tokens) + PROMPT_COST
            for parent, child in self._edges(keys, tokens):
                space.children.setdefault(parent, {})[child] = pid
            while len(space.prompts) > self.max_prompts or space.tokens > self.max_tokens:
                self._drop_oldest(sample, space)
            while sample.cost > self.tenant_budget:
                lru_name, lru = next(iter(sample.spaces.items()))
                self._drop_oldest(sample, lru)
                if not lru.prompts:
                    del sample.spaces[lru_name]

    def _sample_of(self, tenant: str) -> _Sample | None:
        """The tenant's sample, new if there is room for one more tenant; None when `tenants` are sampled."""
        sample = self._samples.get(tenant)
        if sample is None and len(self._samples) < self.tenants:
            sample = self._samples[tenant] = _Sample()
        return sample

    def _space(self, namespace: str) -> _Namespace | None:
        """The sample of one namespace, if any (under the lock)."""
        sample = self._samples.get(tenant_of(namespace))
        return None if sample is None else sample.spaces.get(namespace)

    def _edges(self, keys: list[bytes], tokens: np.ndarray) -> list[tuple[bytes, bytes]]:
        """(parent, child) of every block of a prompt in the trie; a partial last block is a child named by its
        length and tokens (no chain key: partial blocks have none)."""
        parents = [ROOT, *keys]
        edges = list(zip(parents, keys))
        rest = tokens[len(keys) * self.b:]
        if len(rest):
            edges.append((parents[len(keys)], b"partial:" + rest.tobytes()))
        return edges

    def _drop_oldest(self, sample: _Sample, space: _Namespace) -> None:
        pid, prompt = space.prompts.popitem(last=False)
        space.tokens -= len(prompt.tokens)
        sample.cost -= len(prompt.tokens) + PROMPT_COST
        for parent, child in self._edges(prompt.keys, prompt.tokens):
            kids = space.children.get(parent)
            if kids is not None and kids.get(child) == pid:
                del kids[child]
                if not kids:
                    del space.children[parent]

    # --- the end of a request ---------------------------------------------------------------

    def account(self, namespace: str, split: MissSplit, first: FirstAbsent | None, tokens: np.ndarray) -> None:
        """A request's miss tokens by cause (`core.attribution.split_misses`), counted for its tenant; a
        divergence counted at its site."""
        site = None
        if split.divergence is not None and first is not None and first.other is not None:
            site = self._site(split, first, tokens)
        with self._lock:
            tenant = self._tenants.setdefault(tenant_of(namespace), _Tenant())
            tenant.requests += 1
            tenant.prompt_tokens += len(tokens)
            for cause, n in split.tokens.items():
                tenant.miss_tokens[cause] = tenant.miss_tokens.get(cause, 0) + n
            if site is not None:
                have = tenant.sites.get(site.position)
                if have is None:
                    tenant.sites[site.position] = have = Site(site.position)
                have.requests += 1
                have.tokens_lost += split.tokens.get(MissCause.DIVERGED, 0)
                have.blocks_won, have.example = site.blocks_won, site.example
                if len(tenant.sites) > MAX_SITES:
                    del tenant.sites[min(tenant.sites.values(), key=lambda s: s.tokens_lost).position]

    def explain(self, split: MissSplit, first: FirstAbsent | None, tokens: np.ndarray) -> dict[str, Any]:
        """The request's own explanation (usage, on request): tokens by cause and, for a divergence, its site."""
        out: dict[str, Any] = {"causes": {str(c): n for c, n in split.tokens.items()}}
        if split.divergence is not None and first is not None and first.other is not None:
            site = self._site(split, first, tokens)
            out["divergence"] = {"position": site.position, "blocks_won_if_moved_to_end": site.blocks_won,
                                 **site.example}
        return out

    def _site(self, split: MissSplit, first: FirstAbsent, tokens: np.ndarray) -> Site:
        """The divergence of one request: the differing spans (the common suffix removed), decoded, and the blocks
        that would hit with the varying span moved to the end (as core.diff_prompts counts them)."""
        assert split.divergence is not None and first.other is not None
        mine, theirs, t = np.asarray(tokens, dtype=np.uint32), first.other, split.divergence
        n = min(len(mine), len(theirs)) - t
        tail_mine, tail_theirs = mine[len(mine) - n:][::-1], theirs[len(theirs) - n:][::-1]
        differ = np.flatnonzero(tail_mine != tail_theirs)
        suffix = int(differ[0]) if differ.size else n
        common = t + suffix
        won = max(common // self.b - t // self.b, 0)
        example = {"ours": self._show(mine[t:len(mine) - suffix]), "theirs": self._show(theirs[t:len(theirs) - suffix]),
                   "blocks_lost": max(split.tokens.get(MissCause.DIVERGED, 0) // self.b, 0)}
        return Site(t, blocks_won=won, example=example)

    def _show(self, span: np.ndarray) -> str | list[int]:
        ids = [int(x) for x in span[:SPAN_TOKENS]]
        more = len(span) > SPAN_TOKENS
        if self.decode is None:
            return ids
        return self.decode(ids) + ("…" if more else "")

    # --- forgetting ---------------------------------------------------------------------------

    def forget(self, tenant: str) -> int:
        """Drop everything kept of `tenant` (DESIGN rule 12): the sample of each of its namespaces (salted ones too)
        and its causes and sites; how many sampled prompts went."""
        with self._lock:
            sample = self._samples.pop(tenant, None)
            self._tenants.pop(tenant, None)
        return 0 if sample is None else sum(len(space.prompts) for space in sample.spaces.values())

    # --- what the endpoint and the page show ------------------------------------------------

    def report(self, tenant: str | None = None, top: int = 10) -> list[dict[str, Any]]:
        """Per tenant (only `tenant`'s when given): requests, prompt and miss tokens by cause, the top divergence
        sites by tokens lost."""
        with self._lock:
            names = sorted(self._tenants) if tenant is None else [tenant] if tenant in self._tenants else []
            out = []
            for name in names:
                t = self._tenants[name]
                sites = sorted(t.sites.values(), key=lambda s: -s.tokens_lost)[:top]
                out.append({"namespace": name, "requests": t.requests, "prompt_tokens": t.prompt_tokens,
                            "miss_tokens": dict(sorted(t.miss_tokens.items())),
                            "top_divergences": [{"position": s.position, "requests": s.requests,
                                                 "tokens_lost": s.tokens_lost,
                                                 "blocks_won_if_moved_to_end": s.blocks_won, **s.example}
                                                for s in sites]})
        return out

    def sample_bytes(self, namespace: str) -> int:
        """Bytes the sample of one namespace holds: token ids and chain keys (the index's dict overhead apart)."""
        with self._lock:
            space = self._space(namespace)
            if space is None:
                return 0
            return sum(p.tokens.nbytes + 16 * len(p.keys) for p in space.prompts.values())
