import pytest

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
