"""core.attribution: a prompt's miss tokens split by cause, left to right, summing to prompt − cached."""

from hypothesis import given
from hypothesis import strategies as st

from kvledger.core import ModelSpec, decide_hit
from kvledger.core.attribution import BLOCK_CAUSES, MissCause, split_misses

SMOL, V4 = ModelSpec.preset("smollm2-135m"), ModelSpec.preset("tiny-v4")


def test_the_worked_split():
    d = decide_hit(1000, 3, set(), SMOL)          # cap 896, L1 = hit = 384
    s = split_misses(1000, d, 384, 384, MissCause.COLD)
    assert s.tokens == {MissCause.COLD: 512, MissCause.TAIL: 104} and s.divergence is None
    s = split_misses(1000, d, 384, 128, MissCause.DIVERGED, 400)   # 2 blocks promised did not load
    assert s.tokens == {MissCause.LOAD_FAILED: 256, MissCause.DIVERGED: 512, MissCause.TAIL: 104}
    assert s.divergence == 400
    # tiny-v4 (rule 3′): blocks to 640, no snapshot there or below: an exact replay from 0
    d = decide_hit(1000, 5, set(), V4)
    assert (d.hit_tokens, d.cap) == (0, 768)
    s = split_misses(1000, d, 640, 0, MissCause.EXPIRED)
    assert s.tokens == {MissCause.SNAPSHOT_MISSING: 640, MissCause.EXPIRED: 128, MissCause.TAIL: 232}


def test_a_short_prompt_is_all_tail():
    d = decide_hit(100, 0, set(), V4)
    assert split_misses(100, d, 0, 0, MissCause.COLD).tokens == {MissCause.TAIL: 100}


def test_an_engine_that_reused_more_than_the_check_saw():
    d = decide_hit(1000, 3, set(), SMOL)
    s = split_misses(1000, d, 384, 512, MissCause.COLD)   # its device cache held one more block
    assert s.tokens == {MissCause.COLD: 384, MissCause.TAIL: 104}


@given(L=st.integers(0, 5000), blocks=st.integers(0, 50), snap=st.integers(0, 50), lost=st.integers(0, 50),
       cause=st.sampled_from(BLOCK_CAUSES), spec=st.sampled_from([SMOL, V4]))
def test_causes_sum_to_the_miss_and_never_go_negative(L, blocks, snap, lost, cause, spec):
    d = decide_hit(L, blocks, {snap * spec.block_size}, spec)
    l1 = min(blocks * spec.block_size, max(d.cap, 0))
    cached = max(d.hit_tokens - lost * spec.block_size, 0)
    s = split_misses(L, d, l1, cached, cause, 7 if cause is MissCause.DIVERGED else None)
    assert s.total == L - cached and all(n > 0 for n in s.tokens.values())
    assert s.tokens.get(MissCause.TAIL, 0) == L - max(d.cap, 0)
