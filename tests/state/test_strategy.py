import pytest

from kvledger.state.strategy import Strategy, StrategyKind


@pytest.mark.parametrize("text,kind,every", [("memory", StrategyKind.MEMORY, 0), ("full", StrategyKind.FULL, 0),
                                             ("zero", StrategyKind.ZERO, 0),
                                             ("periodic:4096", StrategyKind.PERIODIC, 4096)])
def test_parse(text, kind, every):
    s = Strategy.parse(text)
    assert (s.kind, s.every, str(s)) == (kind, every, text)


@pytest.mark.parametrize("text", ["", "disk", "periodic", "periodic:", "periodic:0", "periodic:-128",
                                  "periodic:x", "memory:5", "full:1"])
def test_parse_rejects(text):
    with pytest.raises(ValueError):
        Strategy.parse(text)


def test_what_each_keeps():
    memory, full, zero = Strategy.parse("memory"), Strategy.parse("full"), Strategy.parse("zero")
    periodic = Strategy.parse("periodic:512")
    assert memory.keeps and not memory.persists(128) and not memory.replay
    assert full.keeps and full.persists(128) and full.persists(130816)
    assert not zero.keeps and zero.replay and not zero.persists(512)
    assert [p for p in range(128, 2049, 128) if periodic.persists(p)] == [512, 1024, 1536, 2048]
    periodic.check(128)
    assert (periodic.checkpoint_every, memory.checkpoint_every, full.checkpoint_every) == (512, 0, 0)
    with pytest.raises(ValueError):
        Strategy.parse("periodic:1000").check(128)
