"""The hit rule (rule 3) and the snapshot store positions (rule 4).

Positions are token indices into the prompt; B = block size, W = window, K = backtrack.
The block ledger decides how far a prefix can be reused (L1); the state ledger decides
whether the last reused block is exact (a snapshot at L1), recomputed (fallback), or
replayed for the sliding-window layers only (bounded replay), or, for a model that was not
trained for the fallback (rule 3′), where an exact resume starts (the latest snapshot ≤ L1).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvledger.core.spec import ModelSpec


class HitKind(StrEnum):
    MISS = "miss"          # nothing reusable (prompt too short, or no leading block cached)
    SNAPSHOT = "snapshot"  # blocks up to L1 and the snapshot at L1: exact resume at L1
    FALLBACK = "fallback"  # no snapshot: the block [L1 - B, L1) is recomputed by every layer
    REPLAY = "replay"      # no snapshot: the block [L1 - B, L1) is replayed by sliding-window layers only
    FULL = "full"          # a model without sliding-window layers: blocks alone decide


@dataclass(frozen=True, slots=True)
class HitDecision:
    """What a request reuses and where computation starts.

    Invariants: 0 <= hit_tokens <= block_hit_tokens <= cap; all three are multiples of B, except for a
    full-attention model's cap of L − 1 (`hit_cap`: a prompt of whole blocks) and a tail handed over
    (`with_tail`, either model kind), which the other two may equal;
    recompute_from <= hit_tokens; block KV in [0, reused_block_tokens) is reused, never recomputed;
    truncate_from is None or equals recompute_from (> 0). A replay with truncate_from None is the
    exact replay of rule 3′ (`exact_replay`).
    """

    kind: HitKind
    hit_tokens: int            # prompt tokens reported as cached
    block_hit_tokens: int      # L1: prompt tokens whose block KV is reused or recomputed-over
    swa_hit: bool              # the snapshot at L1 was used
    recompute_from: int        # first prompt position any layer computes
    truncate_from: int | None  # s: sliding windows start no earlier than this (None: not truncated)
    cap: int                   # the most any hit could be for this prompt length

    @property
    def replay(self) -> bool:
        """Sliding-window layers compute [recompute_from, block_hit_tokens) while block KV there is reused."""
        return self.kind is HitKind.REPLAY

    @property
    def reused_block_tokens(self) -> int:
        """Block KV of [0, this) comes from the ledgers (or the device cache) and is never recomputed or
        overwritten: L1 for a replay, the hit otherwise (a fallback recomputes the block [L1 − B, L1))."""
        return self.block_hit_tokens if self.replay else self.hit_tokens

    @property
    def exact(self) -> bool:
        """No window is truncated: what the request computes equals a cold prefill (rule 9 may store it)."""
        return self.truncate_from is None


def _check_count(name: str, n: object) -> None:
    """`ValueError` unless `n` is an int >= 0 (a bool, a float or a numpy float is refused: 1.5 blocks is a bug)."""
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):  # int and numpy ints, not bool or floats
        raise ValueError(f"{name} must be an integer, got {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


def hit_cap(prompt_len: int, spec: ModelSpec) -> int:
    """The most prompt tokens a hit can reuse; the tokens after it are computed.

    A windowed model: ⌊(L − R) / B⌋ · B, floored at 0 (its windows need the last R tokens computed).
    A full-attention model: min(L − 1, ⌊L / B⌋ · B), floored at 0. Only its last token must be computed (for
    the logits), and the engine owns the device block that token falls in (the reference engine copies a
    block shared through its prefix cache before writing it; vLLM's connector loads into the request's own
    block), so a prompt of whole blocks, all present, loads its last block whole and rewrites one slot.
    Worked example, B = 128, L = 4096, all 32 blocks cached: a block-aligned cap, ⌊4095/128⌋·128 = 3968,
    loads 31 blocks and computes 128 tokens; this one, 4095, loads all 32 and computes 1. At L = 4000 both
    are 3968 (the tail after the last whole block is in no block)."""
    _check_count("prompt_len", prompt_len)
    b = spec.block_size
    if not spec.has_swa:
        return max(min(prompt_len - 1, prompt_len // b * b), 0)
    return max((prompt_len - spec.reserve_tokens) // b * b, 0)


def decided_length(tokens: int, prompt_len: int, spec: ModelSpec) -> int:
    """The length whose hit rule decides a leg that computes `tokens` positions of a request whose own prompt is
    `prompt_len` tokens (a later leg continues it: tokens = the prompt + the output so far; rule 10).

    A model whose computation is anchored at its prompt's end (V4's YoCo: the consumer layers start at
    a = L − yoco_keep of the *request's* prompt, whatever leg computes them) can resume no later than the
    request's own cap, ⌊(L − R)/B⌋·B ≤ a: a snapshot past a would need consumer windows no snapshot holds. So its
    legs are decided as its prompt is (`prompt_len`). Every other model's leg is decided on what it computes
    (`tokens`), which may reach further: a decode leg of Gemma 3 or SmolLM2 hits the blocks its prefill leg
    stored. Example, tiny-v4, L = 645 (a = 511), a decode leg of 646 tokens: its own cap would be 512 > a; decided
    on 645 it is 384."""
    assert 0 < prompt_len <= tokens, (prompt_len, tokens)
    return prompt_len if spec.yoco_keep else tokens


def blocks_spanned(tokens: int, spec: ModelSpec) -> int:
    """⌈tokens / B⌉: the leading blocks that positions [0, tokens) touch. Of a hit's `reused_block_tokens`,
    the blocks whose KV the request takes (the last one only in part at a full-attention hit of L − 1)."""
    assert tokens >= 0
    return -(-tokens // spec.block_size)


def cap_blocks(prompt_len: int, spec: ModelSpec) -> int:
    """The most leading blocks any hit of this prompt takes, ⌈hit_cap / B⌉ (never more than the prompt's
    L // B whole blocks). Full attention, L = 4096: 32; L = 4000: 31."""
    return blocks_spanned(hit_cap(prompt_len, spec), spec)


def block_reach(prompt_len: int, cached_blocks: int, spec: ModelSpec) -> int:
    """L1 of rule 3, in tokens: min(cached_blocks · B, cap), the prefix the block ledger's leading blocks cover
    up to the hit cap (`cached_blocks` may exceed it; a partial block has no key, so it is never cached).
    A multiple of B, except a full-attention cap of L − 1. V4, L = 1000 (cap 768): 5 blocks → 640, 9 → 768."""
    return min(min(cached_blocks, prompt_len // spec.block_size) * spec.block_size, hit_cap(prompt_len, spec))


def decide_hit(
    prompt_len: int,
    cached_blocks: int,
    swa_snapshots: Collection[int],
    spec: ModelSpec,
    *,
    replay: bool = False,
) -> HitDecision:
    """Rules 3 and 3′. `cached_blocks`: leading blocks the block ledger holds (may exceed the cap);
    `swa_snapshots`: positions that hold a snapshot for this prefix (`snapshot_candidates` says which
    ones can matter; `lookup_hit` asks a directory about them and calls this).

    Without a snapshot at L1, what a windowed model does:

        | the model / the request                 | decision                 | exact | hit      |
        |-----------------------------------------|--------------------------|-------|----------|
        | `replay=True` (asked for)               | REPLAY [L1 − B, L1)      | no    | L1       |
        | spec.approximate_fallback (V4's YoCo)   | FALLBACK [L1 − B, L1)    | no    | L1 − B   |
        | any other (rule 3′)                     | SNAPSHOT at the latest   | yes   | q        |
        |                                         | snapshot q < L1, or MISS |       | (or 0)   |

    An exact resume at q < L1 computes [q, L) through every layer: it is the snapshot hit of the
    prefix [0, q), so L1 is lowered to q (`block_hit_tokens` = q). A full-attention model's hit is
    min(cached · B, L − 1) (`hit_cap`)."""
    _check_count("cached_blocks", cached_blocks)
    b = spec.block_size
    cap = hit_cap(prompt_len, spec)
    l1 = block_reach(prompt_len, cached_blocks, spec)
    if l1 == 0:
        return HitDecision(HitKind.MISS, 0, 0, False, 0, None, cap)
    if not spec.has_swa:
        return HitDecision(HitKind.FULL, l1, l1, False, l1, None, cap)
    if l1 in swa_snapshots:
        return HitDecision(HitKind.SNAPSHOT, l1, l1, True, l1, None, cap)
    s = l1 - b
    truncate = s if s > 0 else None  # a window starting at 0 is not truncated
    if replay:
        return HitDecision(HitKind.REPLAY, l1, l1, False, s, truncate, cap)
    if spec.approximate_fallback:
        return HitDecision(HitKind.FALLBACK, s, l1, False, s, truncate, cap)
    q = max((p for p in swa_snapshots if 0 < p < l1 and p % b == 0), default=0)
    if q:
        return HitDecision(HitKind.SNAPSHOT, q, q, True, q, None, cap)
    return HitDecision(HitKind.MISS, 0, 0, False, 0, None, cap)



def check_decision(d: HitDecision, prompt_len: int, spec: ModelSpec) -> None:
    """`ValueError` unless `d` is a decision `decide_hit` (or `exact_replay`) can make for a prompt of
    `prompt_len` tokens of `spec`: the engine's check of a decision made by the entrypoint's CHECK and carried
    to it, O(1) and without the CHECK's inputs (so without hashing or looking anything up again)."""
    b = spec.block_size
    hit, l1, start, s = d.hit_tokens, d.block_hit_tokens, d.recompute_from, d.truncate_from
    handed = is_handed(d, prompt_len, spec)   # `with_tail`: its cap is L − 1
    at_cap = handed or not spec.has_swa and hit == l1 == start == d.cap   # a full-attention hit may end at L − 1
    problems = [
        (d.cap != hit_cap(prompt_len, spec) and not handed, f"its cap {d.cap} is not this prompt's"),
        (not 0 <= start <= hit <= l1 <= d.cap, "needs 0 <= recompute_from <= hit <= L1 <= cap"),
        (not at_cap and (hit % b or l1 % b or start % b), f"positions are multiples of B = {b}"),
        (s is not None and not 0 < s == start, "a truncation starts where computation does"),
        (d.swa_hit != (d.kind is HitKind.SNAPSHOT), "swa_hit says whether a snapshot is used"),
        (d.kind is HitKind.MISS and l1, "a miss reuses nothing"),
        (d.kind is HitKind.FULL and (spec.has_swa or not hit == l1 == start), "FULL is a full-attention hit at L1"),
        (d.kind is not HitKind.FULL and d.kind is not HitKind.MISS and not spec.has_swa,
         f"{d.kind.value} needs sliding-window layers"),
        (d.kind is HitKind.SNAPSHOT and (not hit == l1 == start > 0 or s is not None),
         "a snapshot hit resumes exactly at L1"),
        (d.kind is HitKind.FALLBACK and (hit != l1 - b or start != hit),   # an option for any windowed model
         "a fallback recomputes [L1 − B, L1)"),
        (d.kind is HitKind.REPLAY and not (hit == l1 and start == l1 - b or hit == start == 0 and s is None),
         "a replay replays [L1 − B, L1) or, exactly, [0, L)"),
    ]
    for bad, why in problems:
        if bad:
            raise ValueError(f"decision {d} is not one core.decide_hit makes for this prompt: {why}")

def takes_tail(spec: ModelSpec) -> bool:
    """Whether a P/D decode leg of this model can take its prompt's tail from the prefill engine and compute
    one token (`with_tail`): every window it attends is in a snapshot (R = 1: full attention, Gemma 3). V4's
    YoCo consumer windows are in no snapshot and are rebuilt from the last R = 134 tokens, so its decode leg
    computes them (rule 3)."""
    return spec.reserve_tokens == 1


def tail_parts(prompt_len: int, spec: ModelSpec) -> tuple[int, int]:
    """The bytes of the tail a P/D decode leg of `prompt_len` tokens (the prompt and the first output token)
    takes from its prefill engine, as (block part, window part); the tail is the block part, then the window:

        | block part: the block the prefill's prompt ends in,     | window part: the snapshot at L − 1            |
        |   [⌊(L − 1)/B⌋·B, L − 1), as a ledger block (its layers' |   (`ModelSpec.state_size_to_disk`), in      |
        |   `block_bytes`); 0 bytes when L − 1 is a boundary      |   `Model.export_window`'s layout; windowed only |

    Gemma 3, L = 727: 393,216 + 7,956,480 B; L = 769: 0 + 7,956,480 B. SmolLM2, L = 501: 2,949,120 + 0 B."""
    last = prompt_len - 1
    block = spec.block_bytes() if last % spec.block_size else 0
    return block, spec.state_size_to_disk() if spec.has_swa else 0


def with_tail(d: HitDecision, prompt_len: int, spec: ModelSpec, cached_blocks: int | None = None
              ) -> HitDecision | None:
    """`d` raised to L − 1 by a handed-over tail (P/D, `tail_parts`): the KV of the prompt's positions after its
    last whole block, [⌊(L − 1)/B⌋·B, L − 1), and for a windowed model the windows at L − 1, computed by another
    engine and sent to this one, which then computes only the last token. Only when `d` is exact, the block
    ledger holds every whole block before that tail, and the model `takes_tail`. None when the tail cannot
    raise `d`: V4, a block missing, an approximate decision, or nothing to hand over (a full-attention prompt
    whose L − 1 is a block boundary: `hit_cap` already reaches L − 1).

    `cached_blocks`: the leading blocks the block ledger holds (`decide_hit`'s argument); None: those `d` reuses,
    which is all of them for a full-attention model but may be fewer for a windowed one (its L1 stops at a
    snapshot).

    The raised decision is FULL for a full-attention model, SNAPSHOT at L − 1 for a windowed one (the snapshot
    is the tail's window part, not the state ledger's). Example, B = 128: the prefill engine computed a
    300-token prompt and stored blocks 0 and 1; the decode leg has L = 301 (the prompt and the first output
    token) and d.hit_tokens = 256 (Gemma 3: the snapshot at 256). The tail is [256, 300), and the raised hit is
    300 with cap 300 (`hit_cap` says 256: the tail is in no block)."""
    b, last = spec.block_size, prompt_len - 1
    held = d.block_hit_tokens // b if cached_blocks is None else max(cached_blocks, d.block_hit_tokens // b)
    if not takes_tail(spec) or last <= 0 or sum(tail_parts(prompt_len, spec)) == 0 or not d.exact or held < last // b:
        return None
    if spec.has_swa:
        return HitDecision(HitKind.SNAPSHOT, last, last, True, last, None, last)
    return HitDecision(HitKind.FULL, last, last, False, last, None, last)


def is_handed(d: HitDecision, prompt_len: int, spec: ModelSpec) -> bool:
    """Whether `d` is a decision `with_tail` makes for a prompt of `prompt_len` tokens (hit L − 1 with its cap)."""
    last = prompt_len - 1
    kind = HitKind.SNAPSHOT if spec.has_swa else HitKind.FULL
    return takes_tail(spec) and d.kind is kind and d.hit_tokens == d.block_hit_tokens == d.recompute_from == \
        d.cap == last > 0 and d.truncate_from is None


def resumes_exactly(spec: ModelSpec, *, replay: bool = False) -> bool:
    """Rule 3′: a windowed model that, without a snapshot at L1, resumes exactly rather than approximately
    (it is not trained for the fallback, and no replay was asked for)."""
    return spec.has_swa and not (replay or spec.approximate_fallback)


def exact_replay(prompt_len: int, cached_blocks: int, spec: ModelSpec) -> HitDecision:
    """Rule 3′ with no snapshot in hand (a fault lowered the hit of a model that does not fall back): compute
    [0, L) through every layer, with untruncated windows, while the block KV of [0, L1) is read from the
    blocks, never recomputed or overwritten (so blocks shared through the device cache stay as they are).
    Exact; it reports 0 cached tokens. MISS when no block is in hand."""
    _check_count("cached_blocks", cached_blocks)
    assert spec.has_swa, "a model without sliding-window layers resumes at L1 from its blocks alone"
    cap = hit_cap(prompt_len, spec)
    l1 = block_reach(prompt_len, cached_blocks, spec)
    return HitDecision(HitKind.REPLAY if l1 else HitKind.MISS, 0, l1, False, 0, None, cap)


def snapshot_candidates(prompt_len: int, cached_blocks: int, spec: ModelSpec, *, replay: bool = False) -> list[int]:
    """The snapshot positions `decide_hit` may use for this prompt, ascending: L1 alone for a model that
    falls back (or a replay), every block boundary up to L1 for an exact model (rule 3′). Empty for a
    model without sliding-window layers. `lookup_hit` asks the directory about exactly these."""
    if not spec.has_swa:
        return []
    b = spec.block_size
    l1 = block_reach(prompt_len, cached_blocks, spec)
    if l1 == 0:
        return []
    return list(range(b, l1 + 1, b)) if resumes_exactly(spec, replay=replay) else [l1]


SnapshotLookup = Callable[[Sequence[int]], Collection[int]]
"""Candidate snapshot positions (ascending, each a block boundary) → those that hold a snapshot of this chain.
Metadata only (no KV byte read). A directory that cannot be reached answers no position (rule 8): the lookup's
owner turns the fault into a miss (`state.StateLedger.positions` counts it and answers what it found);
`lookup_hit` catches nothing."""


@dataclass(frozen=True, slots=True)
class HitLookup:
    """What one lookup decided, and how far the blocks alone reach.

    `l1` = min(cached blocks · B, cap), the L1 of rule 3: the blocks a CHECK found present, up to the cap
    (what it refreshes, what a miss split starts its block causes at). Invariant:
    decision.block_hit_tokens <= l1 <= decision.cap; the two differ only where rule 3′ resumes exactly at a
    snapshot q < L1 (block_hit_tokens = q) or finds none (a miss with blocks present)."""

    decision: HitDecision
    l1: int   # tokens

    def branch_point(self, spec: ModelSpec) -> int:
        """Rule 4″ (a): where this prompt's prefill also snapshots because the chain's blocks reach past the
        snapshot it resumes from (another prompt stored them and went on differently): L1, when the decision
        resumes below it on a model with sliding-window layers; 0 (none) otherwise. The second prompt that shares
        a prefix pays for its window once; every later one resumes there.

        Gemma 3, a 1,161-token chat whose first 8 blocks (a system prompt) another conversation stored: L1 = 1024,
        no snapshot there, the decision a miss → 1024. With the snapshot at 1024: a hit there → 0."""
        if not spec.has_swa or self.l1 <= self.decision.hit_tokens or self.l1 % spec.block_size:
            return 0
        return self.l1


def lookup_hit(prompt_len: int, cached_blocks: int, find_snapshots: SnapshotLookup | None, spec: ModelSpec, *,
               replay: bool = False, request_prompt_len: int | None = None) -> HitLookup:
    """The hit lookup, in one place: the candidates `snapshot_candidates` names → `find_snapshots` → `decide_hit`.
    Every CHECK calls it (the entrypoint, the engine's device-cache raise, the vLLM connector, the demo, the
    simulator); none composes the three itself.

    `prompt_len`: the tokens this leg computes; `request_prompt_len`: the request's own prompt when the leg
    continues it (None: the same), so the rule decides on `decided_length` (rule 10). `cached_blocks`: the
    leading blocks present (it may exceed the cap). `find_snapshots` is asked once, and only when there are
    candidates (never for a model without sliding-window layers, nor with no block present); None: no state
    ledger, so no snapshot. It may leave out every position below the highest it finds: `decide_hit` uses the
    snapshot at L1, else the latest one below it.

    Example, tiny-v4 (B = 128, R = 134, resumes exactly), L = 1000, 7 blocks present: cap = 768 = L1; the
    lookup is asked about [128, 256, …, 768]; an answer of {512} gives a snapshot hit at 512 with l1 = 768."""
    length = prompt_len if request_prompt_len is None else decided_length(prompt_len, request_prompt_len, spec)
    at = snapshot_candidates(length, cached_blocks, spec, replay=replay)
    found = find_snapshots(at) if at and find_snapshots is not None else ()
    decision = decide_hit(length, cached_blocks, found, spec, replay=replay)
    return HitLookup(decision, block_reach(length, cached_blocks, spec))


MESSAGE_SNAPSHOTS = 2   # rule 4″ (b): the chat message ends a request snapshots at, at most (the first message's,
                        # a system prompt, and the latest earlier one's)


def message_snapshot_indices(messages: int) -> tuple[int, ...]:
    """Rule 4″ (b): which of a chat's `messages` (the prompt's, the last one included) end where its prefill also
    snapshots, ascending: the first (a system prompt) and the latest earlier ones, `MESSAGE_SNAPSHOTS` at most.
    Never the last message, which ends where the prompt does (rule 4's own positions). 4 messages → (0, 2)."""
    _check_count("messages", messages)
    n = messages - 1
    return tuple(sorted({0, *range(max(n - MESSAGE_SNAPSHOTS + 1, 1), n)})) if n > 0 else ()


def shared_prefix_positions(lookup: HitLookup, spec: ModelSpec, message_ends: Sequence[int] = ()) -> tuple[int, ...]:
    """Rule 4″: the block boundaries where a prefill also snapshots because other prompts likely share the prefix
    up to there: the branch point (`HitLookup.branch_point`), and the last boundary at or before each of
    `message_ends` (token offsets where a chat's earlier messages end). Only those past the decision's hit (the
    prefill computes through them); ascending; empty for a model without sliding-window layers.
    `checkpoint_positions` then drops any at or past the prompt's own rule-4 positions.

    Gemma 3 (B = 128), a new conversation whose 1,061-token system message another one stored: a miss with
    L1 = 1024 and the system message ending at 1,061 → (1024,)."""
    if not spec.has_swa:
        return ()
    b = spec.block_size
    at = {lookup.branch_point(spec), *(end // b * b for end in message_ends)}
    return tuple(sorted(x for x in at if x > lookup.decision.hit_tokens))


def prefill_store_positions(prompt_len: int, spec: ModelSpec) -> tuple[int, ...]:
    """Rule 4: the positions at which prefill stores a snapshot, ascending.

    c = ⌊(L − R)/B⌋·B, the prompt's own hit cap: an identical retry, a regeneration or an
      edit of the last R tokens has L1 = c and resumes exactly;
    p = ⌊(L − 1)/B⌋·B, the last boundary before the last token: a next turn that extends the
      prompt has L1 = p and resumes exactly.
    Each is skipped when 0. With R > B (V4: 134 > 128) c ≤ p − B, so they never coincide; a
    model with R ≤ B may have c = p, stored once. Empty for models without sliding-window
    layers. Only the last chunk of a chunked prefill stores. Both windows lie in the prefill
    kvstore ring (396 for V4): c ≥ L − R − B + 1.

    Worked example (V4, L = 1000): c = ⌊866/128⌋·128 = 768, p = ⌊999/128⌋·128 = 896 → (768, 896).
    """
    if prompt_len < 0:
        raise ValueError("prompt_len must be >= 0")
    if not spec.has_swa:
        return ()
    b = spec.block_size
    c = hit_cap(prompt_len, spec)
    p = (prompt_len - 1) // b * b if prompt_len > 0 else 0
    return tuple(sorted({x for x in (c, p) if x > 0}))


def checkpoint_positions(prompt_len: int, spec: ModelSpec, every: int, *, also: Iterable[int] = ()
                         ) -> tuple[int, ...]:
    """Rule 4′, periodic checkpointing: the multiples of `every` tokens at which a prefill also snapshots, so a
    later prompt that shares only a prefix of this one (a long document, then another question) resumes exactly
    at most `every` tokens before where their blocks part. Ascending; only positions below p =
    ⌊(L − 1)/B⌋·B and other than `prefill_store_positions`' own (which prefill stores anyway). A prefill chunk
    ends at each, where the window is exported (mid-prefill, the ring holds only the latest window). Empty
    when `every` is 0 or the model has no sliding window; `every` is a multiple of B. `also`: further block
    boundaries to snapshot at, under the same rule (a published public prefix's end, rule 12).

    Worked example (Gemma 3, B = 128, every = 512, L = 2000): p = c = 1920 → (512, 1024, 1536)."""
    _check_count("every", every)
    if every % spec.block_size or any(x % spec.block_size for x in also):
        raise ValueError(f"checkpoints every {every} tokens and at {tuple(also)} are not all at block boundaries "
                         f"(B = {spec.block_size})")
    if not spec.has_swa:
        return ()
    own = prefill_store_positions(prompt_len, spec)
    last = own[-1] if own else 0
    periodic = range(every, last, every) if every else range(0)
    return tuple(sorted({x for x in (*periodic, *also) if 0 < x < last and x not in own}))


def decode_replica_positions(prompt_len: int, kv_len: int, spec: ModelSpec) -> range:
    """Rule 4: the multiples of B the sequence crosses while decoding from `prompt_len` to
    `kv_len` tokens of KV; at each, the window is copied into the replica area."""
    if not 0 <= prompt_len <= kv_len:
        raise ValueError("need 0 <= prompt_len <= kv_len")
    if not spec.has_swa:
        return range(0)
    b = spec.block_size
    first = prompt_len // b * b + b
    return range(first, kv_len // b * b + 1, b)


def decode_store_position(prompt_len: int, kv_len: int, spec: ModelSpec) -> int | None:
    """Rule 4: at request end the latest completed replica copy is stored, attached at its boundary."""
    crossed = decode_replica_positions(prompt_len, kv_len, spec)
    return crossed[-1] if crossed else None
