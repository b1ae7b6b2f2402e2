"""Segment I/O a piece at a time (segment_files.py): a helper thread reads piece k + 1 or writes piece k - 1 while
the caller hashes piece k. The file's bytes and every read's outcomes are what one preadv / writev gave."""

from __future__ import annotations

import os
import signal

import pytest

from kvledger.store import segment as sg
from kvledger.store import segment_files as sf
from kvledger.store.backend import ChainWrite
from kvledger.store.lmdb_store import LmdbStore
from kvledger.store.shared_files import SharedFiles
from tests.store.conftest import BLOCK, block_of, chain

N = 10          # blocks per segment
PIECE = 3 * BLOCK   # 3 blocks a piece: a segment is 4 pieces, the last one short


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(sf, "READ_PIECE_BYTES", PIECE)
    monkeypatch.setattr(sf, "WRITE_PIECE_BYTES", PIECE)


def _write(keys, blocks, start=0, parent=bytes(16)) -> ChainWrite:
    return ChainWrite(keys, blocks, start, parent, "default", "agent", 100.0)


def test_pieces_cover_every_buffer_once_in_order():
    views = [memoryview(bytes(BLOCK))] * N
    spans = sf.pieces(views, PIECE)
    assert spans == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sf.pieces(views, 10**9) == [(0, N)] and sf.pieces([], PIECE) == []
    assert all(hi - lo <= sf.IOV_MAX for lo, hi in sf.pieces([memoryview(b"x")] * 3000, 10**9))


def test_a_piece_of_blocks_in_parts_counts_every_part_against_iov_max():
    parts = [[memoryview(b"x")] * 30] * 100   # 3,000 buffers: at most 34 blocks (1,020) a piece
    spans = sf.pieces(parts, 10**9)
    assert spans[0] == (0, 34) and spans[-1][1] == 100
    assert all(30 * (hi - lo) <= sf.IOV_MAX for lo, hi in spans)


@pytest.mark.parametrize("n", [1, 3, N])   # one piece (written inline), an exact piece, several
def test_a_segment_written_in_pieces_is_the_one_shot_layout(tmp_path, n):
    keys, blocks = chain(n)
    write, views = _write(keys, blocks), [memoryview(b) for b in blocks]
    fd = os.open(tmp_path / "seg", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        rows, size = sf.write_segment(fd, write, range(n), views, 1000.0)
    finally:
        os.close(fd)
    meta, want_rows, want_size = sg.encode_chain(write, range(n), views, 1000.0)
    assert (rows, size) == (want_rows, want_size)
    assert (tmp_path / "seg").read_bytes() == meta + b"".join(blocks)


def test_a_read_spanning_two_segments_and_several_pieces_is_exact(tmp_path):
    keys, blocks = chain(2 * N)
    with LmdbStore(tmp_path, fsync=False) as store:
        store.put(_write(keys[:N], blocks[:N]))
        store.put(_write(keys[N:], blocks[N:], N, keys[N - 1]))
        bufs = [bytearray(BLOCK) for _ in keys]
        assert store.get_into(keys, bufs) == [BLOCK] * (2 * N)
        assert [bytes(b) for b in bufs] == [block_of(k) for k in keys]
        assert store.counters.blocks_read == 2 * N


def _shared(tmp_path, n=N):
    files = SharedFiles(tmp_path, fsync=False)
    keys, blocks = chain(n)
    located = list(enumerate(files.write(_write(keys, blocks), range(n), [memoryview(b) for b in blocks], 1000.0)))
    return files, keys, located


def test_a_corrupt_block_in_a_later_piece_is_that_block_only(tmp_path):
    files, keys, located = _shared(tmp_path)
    bad = located[7][1]   # the third piece
    with open(files.files.seg_dir / bad.name, "r+b") as f:
        f.seek(bad.offset + 100)
        byte = f.read(1)
        f.seek(bad.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    bufs = [bytearray(BLOCK) for _ in keys]
    out = files.read(located, bufs)
    assert out == [BLOCK] * 7 + ["corrupt"] + [BLOCK] * 2
    assert all(bytes(bufs[i]) == block_of(keys[i]) for i in range(N) if i != 7)
    files.close()


def test_blocks_read_into_parts_are_checked_whole_and_a_corrupt_one_is_that_block_only(tmp_path):
    """Each block scattered over three parts (as the engine's fetcher reads them into its layers): the bytes land in
    order, and the checksum covers all the parts (a flipped byte in the last part fails that block alone)."""
    files, keys, located = _shared(tmp_path)
    bad = located[5][1]
    with open(files.files.seg_dir / bad.name, "r+b") as f:
        f.seek(bad.offset + BLOCK - 10)
        byte = f.read(1)
        f.seek(bad.offset + BLOCK - 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    dests = [(bytearray(1000), bytearray(2000), bytearray(BLOCK - 3000)) for _ in keys]
    out = files.read(located, dests)
    assert out == [BLOCK] * 5 + ["corrupt"] + [BLOCK] * 4
    assert all(b"".join(dests[i]) == block_of(keys[i]) for i in range(N) if i != 5)
    files.close()


@pytest.mark.parametrize("cut_block", [0, 4, 6, 9])   # in the first piece, mid-piece, at a piece's start, the last
def test_a_segment_cut_short_reads_what_is_there_and_the_rest_is_truncated(tmp_path, cut_block):
    files, keys, located = _shared(tmp_path)
    loc = located[cut_block][1]
    os.truncate(files.files.seg_dir / loc.name, loc.offset + BLOCK // 2)
    bufs = [bytearray(BLOCK) for _ in keys]
    out = files.read(located, bufs)
    assert out == [BLOCK] * cut_block + ["truncated"] * (N - cut_block)
    assert all(bytes(bufs[i]) == block_of(keys[i]) for i in range(cut_block))
    files.close()


def test_a_segment_gone_or_unreadable_is_every_block_of_its_run(tmp_path, monkeypatch):
    files, keys, located = _shared(tmp_path)
    real = sf.preadv_all
    second_piece = located[3][1].offset

    def failing_later(fd, views, offset):   # the second piece fails, on a fresh descriptor too (EIO)
        if offset == second_piece:
            raise OSError(5, "Input/output error")
        return real(fd, views, offset)

    monkeypatch.setattr(sf, "preadv_all", failing_later)
    assert files.read(located, [bytearray(BLOCK) for _ in keys]) == ["unreadable"] * N
    monkeypatch.setattr(sf, "preadv_all", real)
    assert files.read(located, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * N   # dropped, opened again
    os.unlink(files.files.seg_dir / located[0][1].name)
    files.files.close()
    assert files.files.read_blocks(located, [bytearray(BLOCK) for _ in keys]) == ["missing"] * N
    files.close()


def test_a_forked_child_gets_its_own_helper_threads(tmp_path):
    files, keys, located = _shared(tmp_path)
    assert files.read(located, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * N   # the parent's helpers exist
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child reports through its exit code
        signal.alarm(20)   # a child waiting on its parent's helper threads (which it does not have) dies
        ok = files.read(located, [bytearray(BLOCK) for _ in keys]) == [BLOCK] * N
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    files.close()


def _flip(files, loc, at):
    with open(files.files.seg_dir / loc.name, "r+b") as f:
        f.seek(loc.offset + at)
        byte = f.read(1)
        f.seek(loc.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_read_part_by_part_lands_each_part_before_its_call_and_checks_every_block(tmp_path):
    """`read_by_part` (the fetcher's layer-by-layer read): part k of every block is in when `on_part(k + 1)` comes;
    a flipped byte in the last part fails that block alone, and only once its last part is in; a cut segment
    leaves the blocks past the cut truncated; a segment gone is missing; the intact blocks are exact."""
    files, keys, located = _shared(tmp_path)
    _flip(files, located[5][1], BLOCK - 10)
    os.truncate(files.files.seg_dir / located[8][1].name, located[8][1].offset + 1500)   # inside block 8's part 2
    cuts = (1000, 2000, BLOCK - 3000)
    dests = [tuple(bytearray(n) for n in cuts) for _ in keys]
    calls = []

    def on_part(k):
        calls.append(k)
        for i in range(8):   # the blocks before the cut: part k - 1 is in, the bytes of the file as they are
            want = block_of(keys[i])[sum(cuts[:k - 1]):sum(cuts[:k])]
            assert (bytes(dests[i][k - 1]) == want) != (i == 5 and k == 3)

    out = files.read(located, dests, on_part)
    assert calls == [1, 2, 3]
    assert out == [BLOCK] * 5 + ["corrupt"] + [BLOCK] * 2 + ["truncated"] * 2
    assert all(b"".join(dests[i]) == block_of(keys[i]) for i in range(8) if i != 5)
    os.unlink(files.files.seg_dir / located[0][1].name)
    files.files.close()
    assert files.files.read_blocks(located, dests, calls.append) == ["missing"] * N and calls[3:] == [1, 2, 3]
    files.close()
