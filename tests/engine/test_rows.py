"""Row copies of byte views: the same bytes as a plain uint8 copy, through the widest view the tensors allow."""

import pytest
import torch

from kvledger.engine.rows import index_copy_rows, index_select_rows, widest


def test_aligned_rows_go_eight_bytes_at_a_time():
    dst, src = torch.zeros(6, 64, dtype=torch.uint8), torch.zeros(2, 192, dtype=torch.uint8)
    assert [v.dtype for v in widest(dst, src[:, 64:128])] == [torch.int64, torch.int64]
    assert [v.dtype for v in widest(dst, src[:, 66:130])] == [torch.int16, torch.int16]   # offset 2
    assert [v.dtype for v in widest(dst[:, 1:40], src[:, 1:40])] == [torch.uint8, torch.uint8]


@pytest.mark.parametrize("width,start", [(64, 64), (64, 68), (40, 3), (9, 0)])
def test_copies_match_a_plain_byte_copy(width, start):
    g = torch.Generator().manual_seed(width + start)
    rows = torch.randint(0, 256, (3, 256), dtype=torch.uint8, generator=g)
    src = rows[:, start:start + width]                 # a column span: strided rows
    ids = torch.tensor([4, 0, 2])
    dst = torch.randint(0, 256, (5, width), dtype=torch.uint8, generator=g)
    want = dst.clone()
    for i, b in enumerate(ids.tolist()):
        want[b] = src[i]
    index_copy_rows(dst, ids, src)
    assert torch.equal(dst, want)
    out = torch.zeros(3, 256, dtype=torch.uint8)
    index_select_rows(dst, ids, out[:, start:start + width])
    assert torch.equal(out[:, start:start + width], src) and not out[:, :start].any()
