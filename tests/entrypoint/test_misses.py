"""The miss book (entrypoint/misses.py): the first absent block's cause from the sample of recent prompts, the
divergence sites, the caps, and namespaces kept apart."""

from __future__ import annotations

import numpy as np

from kvledger.core import ModelSpec, chain_keys, decide_hit, diff_prompts, salted_namespace
from kvledger.core.attribution import MissCause, split_misses
from kvledger.entrypoint.misses import PROMPT_COST, MissBook
from kvledger.store.backend import Gone

SPEC = ModelSpec.preset("smollm2-135m")
B = SPEC.block_size


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 40000, n).astype(np.uint32)


def sampled(book: MissBook, ns: str, tokens: np.ndarray) -> list[bytes]:
    keys = chain_keys(tokens, SPEC, ns)
    book.add(ns, tokens, keys)
    return keys


def test_a_changed_token_is_a_divergence_at_that_token_and_new_content_is_cold():
    book = MissBook(B)
    a = prompt(1000, 1)
    sampled(book, "alpha", a)
    b = a.copy()
    b[277] += 1                                   # a timestamp near the front
    keys = chain_keys(b, SPEC, "alpha")
    first = book.first_absent("alpha", b, keys, 277 // B, None)
    assert first.cause is MissCause.DIVERGED and first.divergence == 277 and first.start == 256
    c = np.concatenate([a, prompt(400, 2)])       # the next turn: a's prefix, then new tokens
    first = book.first_absent("alpha", c, chain_keys(c, SPEC, "alpha"), len(a) // B, None)
    assert first.cause is MissCause.COLD          # nothing sampled went on past a's end
    d = prompt(1000, 3)                           # never seen
    assert book.first_absent("alpha", d, chain_keys(d, SPEC, "alpha"), 0, None).cause is MissCause.COLD
    # the same prompt, asked by another namespace, finds nothing of alpha's
    assert book.first_absent("beta", b, chain_keys(b, SPEC, "beta"), 0, None).cause is MissCause.COLD
    # a tombstone decides first
    first = book.first_absent("alpha", b, keys, 2, Gone("expired", 1.0e9))
    assert first.cause is MissCause.EXPIRED and first.gone_at == 1.0e9


def test_the_divergence_site_says_what_varies_and_what_moving_it_wins():
    book = MissBook(B)
    a = prompt(2048, 4)
    sampled(book, "alpha", a)
    b = a.copy()
    b[277:281] = [5, 6, 7, 8]                     # four tokens vary; the rest is the same
    keys = chain_keys(b, SPEC, "alpha")
    first = book.first_absent("alpha", b, keys, 2, None)
    d = decide_hit(len(b), 2, set(), SPEC)
    split = split_misses(len(b), d, first.start, d.hit_tokens, first.cause, first.divergence, first.diverged_block)
    book.account("alpha", split, first, b)
    explained = book.explain(split, first, b)
    div = explained["divergence"]
    assert div["position"] == 277 and div["ours"] == [5, 6, 7, 8] and div["theirs"] == [int(x) for x in a[277:281]]
    assert div["blocks_won_if_moved_to_end"] == (2048 - 4) // B - 2   # the common prefix and suffix, as one prefix
    assert div["blocks_won_if_moved_to_end"] == diff_prompts(a.tolist(), b.tolist(), SPEC, "alpha").recoverable_blocks
    assert explained["causes"] == {"diverged": split.tokens[MissCause.DIVERGED], "tail": split.tokens[MissCause.TAIL]}
    (alpha,) = book.report("alpha")
    site = alpha["top_divergences"][0]
    assert site["position"] == 277 and site["requests"] == 1 and site["tokens_lost"] == d.cap - 256
    assert book.report("beta") == [] and [t["namespace"] for t in book.report()] == ["alpha"]


def test_the_sample_keeps_to_its_caps_and_forgets_what_it_dropped():
    book = MissBook(B, max_prompts=4, max_tokens=4 * 1000, max_total_tokens=6 * 1000)
    first = prompt(1000, 10)
    sampled(book, "alpha", first)
    for seed in range(11, 15):                    # 4 more: the first one gives way
        sampled(book, "alpha", prompt(1000, seed))
    changed = first.copy()
    changed[300] += 1
    keys = chain_keys(changed, SPEC, "alpha")
    assert book.first_absent("alpha", changed, keys, 2, None).cause is MissCause.COLD   # forgotten
    per_prompt = 1000 * 4 + 16 * (1000 // B)
    assert book.sample_bytes("alpha") == 4 * per_prompt
    salted = salted_namespace("alpha", "x")
    for seed in range(20, 23):                    # a salt of the same tenant: its budget makes alpha give way
        sampled(book, salted, prompt(1000, seed))
    fit = 6 * 1000 // (1000 + PROMPT_COST)        # the prompts the tenant's budget holds
    assert book.sample_bytes("alpha") + book.sample_bytes(salted) == fit * per_prompt
    assert book.sample_bytes(salted) == 3 * per_prompt
    sampled(book, "beta", prompt(1000, 30))       # another tenant: beyond the one this book samples
    assert book.sample_bytes("beta") == 0 and book.sample_bytes(salted) == 3 * per_prompt


def _edited(tokens: np.ndarray, at: int) -> np.ndarray:
    """`tokens` with the token at `at` changed (a probe whose cause is `diverged` while `tokens` is sampled)."""
    out = tokens.copy()
    out[at] += 1
    return out


def _cause(book: MissBook, ns: str, tokens: np.ndarray, blocks: int) -> MissCause:
    return book.first_absent(ns, tokens, chain_keys(tokens, SPEC, ns), blocks, None).cause


def test_one_tenants_salted_flood_never_evicts_another_tenants_sample():
    """Issue 54: tenant beta's prompts under 50 cache salts (50,000 tokens, six times the whole sample) evicted
    alpha's sample, so alpha's edit of its own prompt turned from `diverged` to `cold`. The salts of one tenant
    count against that tenant: beta keeps at most its share, and alpha's sample stays."""
    caps = {"max_prompts": 4, "max_tokens": 4 * 1000, "max_total_tokens": 8 * 1000}
    book = MissBook(B, tenants=2, **caps)
    a = prompt(1000, 30)
    sampled(book, "alpha", a)
    assert _cause(book, "alpha", _edited(a, 300), 2) is MissCause.DIVERGED
    salts = [salted_namespace("beta", f"salt-{i}") for i in range(50)]
    for i, ns in enumerate(salts):
        sampled(book, ns, prompt(1000, 100 + i))
    assert _cause(book, "alpha", _edited(a, 300), 2) is MissCause.DIVERGED
    per_prompt = 1000 * 4 + 16 * (1000 // B)
    beta_bytes = sum(book.sample_bytes(ns) for ns in salts)
    assert 0 < beta_bytes <= caps["max_total_tokens"] // 2 * 4 and beta_bytes % per_prompt == 0   # beta's half


def test_a_tenant_cannot_see_another_tenants_traffic_through_its_own_probes():
    """Issue 54: a tenant holding the sample at its cap saw the cause of its own probe flip from `diverged` to
    `cold` when another tenant's 1,024-token prompt made the global cap evict its oldest prompt. Now no
    tenant's prompt moves another's sample: beta's probes answer the same before and after alpha's traffic."""
    book = MissBook(B, tenants=2, max_prompts=4, max_tokens=4 * 1000, max_total_tokens=8 * 1000)
    mine = [(salted_namespace("beta", f"salt-{i % 2}"), prompt(1000, 200 + i)) for i in range(8)]   # 8,000 tokens
    for ns, tokens in mine:
        sampled(book, ns, tokens)

    def probes() -> list[MissCause]:
        return [_cause(book, ns, _edited(tokens, 300), 2) for ns, tokens in mine]

    before = probes()
    assert MissCause.DIVERGED in before
    sampled(book, "alpha", prompt(1024, 300))   # the other tenant's prompt that beta should not see
    assert probes() == before


def test_forget_drops_a_tenants_sample_and_sites_with_its_salts():
    """DESIGN rule 12: a forgotten tenant's prompts leave the sample (each of its salted namespaces' too), and its
    causes and sites go; another tenant's stay, and its place in the sample is free for another tenant."""
    book = MissBook(B, tenants=2)
    a = prompt(1000, 1)
    salted = salted_namespace("alpha", "s")
    for ns in ("alpha", salted, "beta"):
        sampled(book, ns, a)
    book.account("alpha", split_misses(1000, decide_hit(1000, 0, set(), SPEC), 0, 0, MissCause.COLD), None, a)
    assert book.forget("alpha") == 2 and book.forget("alpha") == 0
    b = a.copy()
    b[277] += 1
    for ns in ("alpha", salted):
        assert book.first_absent(ns, b, chain_keys(b, SPEC, ns), 2, None).cause is MissCause.COLD
    assert book.first_absent("beta", b, chain_keys(b, SPEC, "beta"), 2, None).cause is MissCause.DIVERGED
    assert book.report("alpha") == [] and book.sample_bytes("beta") > 0
    sampled(book, "gamma", a)                    # alpha's place is free again: a second tenant is sampled
    assert book.sample_bytes("gamma") > 0
