import random

from kvledger import HitKind, ModelSpec, diff_prompts

V4 = ModelSpec.preset("deepseek-v4.1-flash")
LLAMA = ModelSpec.preset("smollm2-135m")


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def test_timestamp_near_the_front():
    a = _prompt(2000)
    b = list(a)
    b[300:304] = [11, 12, 13, 14]  # a timestamp's digits at token ~300
    d = diff_prompts(a, b, V4)
    assert d.first_divergence == 300
    assert d.hit_blocks == 300 // 128 == 2
    assert (d.a_span, d.b_span) == ((300, 304), (300, 304))
    assert d.recoverable_blocks == (2000 - 4) // 128 - 2
    assert "token 300 differs" in d.reasons[0]


def test_identical_prompts():
    a = _prompt(1000)
    d = diff_prompts(a, list(a), LLAMA)
    assert d.first_divergence is None and d.hit_blocks == 7 and d.reasons == ("prompts are identical",)
    assert d.decision.hit_tokens == 896  # R = 1: (1000 - 1) // 128 * 128


def test_next_turn_extends_the_previous_one():
    a = _prompt(1000)
    b = a + _prompt(300, seed=1)
    d = diff_prompts(a, b, V4)
    assert d.first_divergence == 1000 and d.hit_blocks == 7
    # A's prefill stored its snapshot at 896 = L1 for B: an exact hit
    assert d.decision.kind is HitKind.SNAPSHOT and d.decision.hit_tokens == 896
    assert any("past A's last full block" in r for r in d.reasons)


def test_divergence_in_the_first_block_hits_nothing():
    a = _prompt(600)
    b = [a[0] + 1] + a[1:]
    d = diff_prompts(a, b, V4)
    assert d.first_divergence == 0 and d.hit_blocks == 0 and d.decision.hit_tokens == 0


def test_insertion_shifts_everything():
    a = _prompt(1500)
    b = a[:400] + [7, 7, 7] + a[400:]
    d = diff_prompts(a, b, V4)
    assert d.first_divergence == 400 and d.hit_blocks == 3
    assert d.a_span == (400, 400) and d.b_span == (400, 403)
    assert d.recoverable_blocks == 1500 // 128 - 3


def test_namespaces_do_not_share_hits():
    a = _prompt(600)
    assert diff_prompts(a, a, V4, "t1").hit_blocks == 4


def test_namespaces_do_not_share_hits_across_tenants():
    """Diffing a prompt against itself across two tenants: a diff that ignored the namespace would hit."""
    a = _prompt(600)
    d = diff_prompts(a, a, V4, "t1", "t2")
    assert d.hit_blocks == 0 and d.decision.hit_tokens == 0 and d.recoverable_blocks == 0
    assert "different namespaces" in d.reasons[0]
    assert diff_prompts(a, a, V4, "t1", "t1").hit_blocks == 4


def test_any_namespace_diffs():
    a = _prompt(300)
    for ns in ("\ud800", "x" * (1 << 17)):
        assert diff_prompts(a, a, V4, ns).hit_blocks == 2 and diff_prompts(a, a, V4, ns, ns + "x").hit_blocks == 0
