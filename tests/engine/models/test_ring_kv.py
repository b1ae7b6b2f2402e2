"""RingKV, the sliding-window layer's ring (Gemma 3's geometry): what it holds, and snapshots out and back."""

import pytest
import torch

from kvledger.core import ModelSpec
from kvledger.engine.models.ring_kv import RingKV

SPEC = ModelSpec.preset("gemma3-270m")


def _ring(slots: int = 2) -> RingKV:
    ring = RingKV(SPEC, kv_heads=1, head_dim=256)
    ring.allocate(num_blocks=0, num_slots=slots, device=torch.device("cpu"))
    return ring


def _kv(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K = position, V = −position in every element: bf16-exact up to 256, which the tests stay under."""
    pos = torch.arange(lo, hi, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 256)
    return pos % 256, -(pos % 256)


def test_sizes_are_the_specs():
    ring = _ring()
    assert (ring.ring_len, ring.snapshot_len, ring.window) == (646, 518, 512)
    assert ring.window_bytes == 518 * 1_024 and ring.block_bytes == 0
    assert 15 * ring.window_bytes == SPEC.state_size_to_disk()


def test_the_ring_keeps_the_newest_rows_across_chunks():
    ring = _ring()
    ring.reset(0, 0)
    for lo, hi in ((0, 200), (200, 400), (400, 900)):   # the last chunk is longer than what the ring keeps
        ring.write(0, lo, *_kv(lo, hi))
    k, v = ring.read(0, 900 - 646, 900)
    assert torch.equal(k.float(), _kv(254, 900)[0]) and torch.equal(v.float(), _kv(254, 900)[1])
    with pytest.raises(AssertionError, match="holds"):
        ring.read(0, 253, 900)   # overwritten
    with pytest.raises(AssertionError, match="ring ends"):
        ring.write(0, 901, *_kv(901, 902))   # a gap


def test_a_snapshot_restores_the_window_in_another_slot():
    ring = _ring()
    ring.reset(0, 0)
    ring.write(0, 0, *_kv(0, 700))
    out = torch.zeros(ring.window_bytes, dtype=torch.uint8)
    ring.export_window(0, 640, out)              # the rule-4′ position of a 700-token prompt: still in the ring
    ring.import_window(1, 640, out)
    assert (ring.valid_from[1], ring.end[1]) == (640 - 518, 640)
    assert all(torch.equal(a, b) for a, b in zip(ring.read(1, 122, 640), ring.read(0, 122, 640)))


def test_a_short_window_is_zeros_before_position_0():
    ring = _ring()
    ring.reset(0, 0)
    ring.write(0, 0, *_kv(0, 130))
    out = torch.zeros(ring.window_bytes, dtype=torch.uint8)
    ring.export_window(0, 128, out)
    rows = out.view(torch.bfloat16).view(518, 2, 1, 256)
    assert not rows[:518 - 128].any() and torch.equal(rows[518 - 128:, 0].float(), _kv(0, 128)[0])
    ring.import_window(1, 128, out)
    assert (ring.valid_from[1], ring.end[1]) == (0, 128)
