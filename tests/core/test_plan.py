import pytest

from kvledger import ModelSpec
from kvledger.core import Link, Traffic, break_even_tokens, plan

V4 = ModelSpec.preset("deepseek-v4.1-flash")
SMOL = ModelSpec.preset("smollm2-135m")


def test_v4_flash_128k():
    p = plan(V4, 131072)
    assert p.block_bytes == 113_920
    assert p.swa_snapshot_bytes == 1_415_040
    assert p.hit_eligible_tokens == 130_816
    assert p.blocks_per_prompt == 1024 and p.prompt_kv_bytes == 1024 * 113_920
    assert p.prefill_s == pytest.approx(13.0)  # the published no-hit figure is the default throughput


def test_storage_is_written_bytes_times_ttl():
    t = Traffic(requests_per_day=1000, reuse=0.0, mix={"agent": 0.25, "chatbot": 0.75})
    p = plan(V4, 1280 + 50, t)  # 10 full blocks per request; the partial block is never stored
    per_day = 1000 * 10 * 113_920
    assert p.bytes_written_per_day == per_day
    assert p.storage_bytes_by_class == {"agent": int(per_day * 0.25 * 3), "chatbot": int(per_day * 0.75 * 7)}
    assert p.storage_bytes == sum(p.storage_bytes_by_class.values())


def test_reuse_and_decode_writes():
    base = plan(V4, 12800, Traffic(requests_per_day=1, reuse=0.5))
    assert base.bytes_written_per_day == 50 * 113_920
    more = plan(V4, 12800, Traffic(requests_per_day=1, reuse=0.5, output_tokens=1280))
    assert more.bytes_written_per_day == 60 * 113_920


def test_hit_is_faster_than_prefill_for_long_prompts():
    p = plan(V4, 131072)
    assert p.ttft_hit_s < p.prefill_s / 10 and p.speedup > 10


def test_break_even():
    # fetching 890 B/token at 1 MB/s costs 0.89 ms/token; computing costs 0.1 ms/token: never worth it
    assert break_even_tokens(V4, Link(fetch_bytes_per_s=1e6, prefill_tokens_per_s=10_000)) is None
    # gain per token = 1/1000 - 890/1e9 ≈ 0.99911 ms; 1 s latency → 1000.9 tokens → 8 blocks
    assert break_even_tokens(V4, Link(fetch_bytes_per_s=1e9, fetch_latency_s=1.0, prefill_tokens_per_s=1000)) == 1024


@pytest.mark.parametrize("kw", [dict(reuse=1.5), dict(mix={"agent": 0.3}), dict(mix={"x": 1.0}),
                                dict(requests_per_day=-1), dict(ttl_days={"agent": 0, "chatbot": 7})])
def test_bad_traffic_is_refused(kw):
    with pytest.raises(ValueError):
        Traffic(**kw)


def test_prefill_is_priced_at_the_models_own_rate():
    """Each preset states its prefill rate and its source; `plan` uses it unless a link says otherwise."""
    for name in ModelSpec.presets():
        spec = ModelSpec.preset(name)
        assert spec.prefill_tokens_per_s > 0 and spec.prefill_source, name
    assert plan(SMOL, 2048).prefill_s == pytest.approx(2048 / 800)   # ~2.5 s, as measured (issue 18)
    assert plan(V4, 2048).prefill_s == pytest.approx(2048 * 13 / 131072)
    given = plan(SMOL, 2048, link=Link.of(SMOL, prefill_tokens_per_s=100))
    assert given.prefill_s == pytest.approx(20.48) and given.prefill_source == "given"


def test_a_model_without_sliding_windows_has_no_snapshot_and_no_rings():
    p = plan(SMOL, 2048)
    assert not p.has_swa and (p.swa_snapshot_bytes, p.inference_ring, p.kvstore_ring) == (None, None, None)
    assert p.reserve_tokens == 1 and p.hit_eligible_tokens == 2047   # L − 1: every block present
    v4 = plan(V4, 2048)
    assert v4.has_swa and (v4.swa_snapshot_bytes, v4.inference_ring, v4.kvstore_ring) == (1_415_040, 134, 396)


def test_the_prefill_rate_is_not_part_of_the_chain_keys():
    """A re-measured rate must not orphan every stored block: the fingerprint ignores it."""
    from dataclasses import replace

    assert replace(SMOL, prefill_tokens_per_s=1.0, prefill_source="x").fingerprint() == SMOL.fingerprint()
