"""The miss book (entrypoint/misses.py): the first absent block's cause from the sample of recent prompts, the
divergence sites, the caps, and namespaces kept apart."""

from __future__ import annotations

import numpy as np

from kvledger.core import ModelSpec, chain_keys, decide_hit, diff_prompts
from kvledger.core.attribution import MissCause, split_misses
from kvledger.entrypoint.misses import MissBook
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
    assert book.sample_bytes("alpha") == 4 * (1000 * 4 + 16 * (1000 // B))
    for seed in range(20, 23):                    # another namespace: the total cap makes alpha give way
        sampled(book, "beta", prompt(1000, seed))
    assert book.sample_bytes("alpha") + book.sample_bytes("beta") <= 6 * (1000 * 4 + 16 * (1000 // B))
    assert book.sample_bytes("beta") == 3 * (1000 * 4 + 16 * (1000 // B))


def test_forget_drops_a_tenants_sample_and_sites_with_its_salts():
    """DESIGN rule 12: a forgotten tenant's prompts leave the sample (each of its salted namespaces' too), and its
    causes and sites go; another tenant's stay, and the sample's totals shrink by what went."""
    from kvledger.core import salted_namespace

    book = MissBook(B)
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
    assert book.report("alpha") == [] and book.sample_bytes("beta") > 0 and book._total == 1000
