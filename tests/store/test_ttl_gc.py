import math

import pytest

from kvledger.store import gc as gcplan
from kvledger.store.index import Entry, Segment
from kvledger.store.ttl import DAY_S, TtlPolicy


def test_default_classes_and_bindings():
    p = TtlPolicy.parse(namespaces="tenantA=agent")
    assert p.resolve("tenantA") == ("agent", 3 * DAY_S)
    assert p.resolve("other") == ("chatbot", 7 * DAY_S)
    assert p.resolve("tenantA", "chatbot") == ("chatbot", 7 * DAY_S)  # per request wins
    assert TtlPolicy.parse("agent=1").resolve("x", "agent") == ("agent", DAY_S)
    with pytest.raises(ValueError):
        p.resolve("x", "nope")
    with pytest.raises(ValueError):
        TtlPolicy.parse(namespaces="a=unknown")


def _entries(spec):
    """spec: list of (key, parent, pos, expiry, last_hit)."""
    seg = Segment("s", "ns", "c", 1.0, 0.0, 0, 0)
    return [Entry(k, p, pos, 10, 0, 0, seg, i, exp, hit) for i, (k, p, pos, exp, hit) in enumerate(spec)]


def test_expired_tails_first_and_orphans():
    es = _entries([(b"a", b"r", 0, 100, 0), (b"b", b"a", 1, 50, 0), (b"c", b"b", 2, 500, 0),
                   (b"x", b"gone", 3, 500, 0)])
    due = gcplan.expired_tails_first(es, now=60)
    # b expired; c outlives its parent, so it goes too (it can never match); x is an orphan
    assert [e.key for e in due] == [b"x", b"c", b"b"]
    assert [e.pos for e in due] == sorted((e.pos for e in due), reverse=True)


def test_lru_evicts_tails_first_and_never_a_parent_before_its_child():
    es = _entries([(b"a", b"r", 0, math.inf, 10), (b"b", b"a", 1, math.inf, 30), (b"c", b"b", 2, math.inf, 20),
                   (b"d", b"r", 0, math.inf, 5)])
    order = gcplan.lru_tails_first(es, need_bytes=40)
    # effective last hits: a 10, b 10, c 10, d 5 → d first, then c, b, a (tails first)
    assert [e.key for e in order] == [b"d", b"c", b"b", b"a"]
    assert [e.key for e in gcplan.lru_tails_first(es, need_bytes=15)] == [b"d", b"c"]
    assert gcplan.lru_tails_first(es, 0) == []
