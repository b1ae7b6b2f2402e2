import os
import threading
from pathlib import Path

import pytest

from kvledger.core import ModelSpec
from kvledger.state.pool import PAGE, SlotPool, checksum


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_slot_size_is_the_stored_region_of_the_spec():
    spec = ModelSpec.preset("deepseek-v4.1-flash")
    with SlotPool.for_spec(spec, 10 << 20) as pool:
        assert pool.slot_bytes == 20 * 134 * 528 == 1_415_040
        assert pool.stride % PAGE == 0 and pool.stride >= pool.slot_bytes
        assert pool.capacity == (10 << 20) // pool.stride == 7
    with pytest.raises(ValueError):
        SlotPool.for_spec(spec, 1 << 20)  # not one whole slot
    with pytest.raises(ValueError):
        SlotPool.for_spec(ModelSpec.preset("smollm2-135m"), 1 << 30)  # no sliding window: no state


def test_put_get_and_the_segment_is_shared_memory():
    with SlotPool(1000, 2) as pool:
        data = os.urandom(1000)
        assert pool.put(_key(1), 128, data) == (True, [])
        assert pool.get(_key(1)) == data and pool.position(_key(1)) == 128
        out = bytearray(1000)
        assert pool.read_into(_key(1), out) == 1000 and out == data
        assert pool.get(_key(2)) is None and pool.read_into(_key(2), out) is None
        assert Path("/dev/shm", pool.name.lstrip("/")).exists()
        name = pool.name
    assert not Path("/dev/shm", name.lstrip("/")).exists()  # closed: the segment is gone


def test_a_stored_snapshot_is_immutable():
    with SlotPool(100, 2) as pool:
        pool.put(_key(1), 128, b"a" * 100)
        assert pool.put(_key(1), 128, b"b" * 100).stored
        assert pool.get(_key(1)) == b"a" * 100


def test_lru_eviction_skips_pinned_slots():
    evicted: list[bytes] = []
    with SlotPool(100, 3) as pool:
        pool.on_evict = evicted.extend
        for i in range(3):
            pool.put(_key(i), 128 * (i + 1), bytes([i]) * 100)
        assert pool.get(_key(0)) is not None  # 0 is now the most recent; 1 is the oldest
        pinned = pool.pin(_key(1))
        assert pinned is not None and pool.can_allocate()
        result = pool.put(_key(3), 512, b"x" * 100)
        assert result == (True, [_key(2)]) and evicted == [_key(2)]  # 1 is older but pinned
        assert bytes(pinned.view) == bytes([1]) * 100  # the reader's bytes never changed
        pool.pin(_key(0))
        pool.pin(_key(3))
        assert not pool.can_allocate()  # every slot pinned
        assert pool.put(_key(4), 640, b"y" * 100) == (False, [])
        assert pool.discard(_key(1)) is False  # pinned: stays
        pinned.view.release()
        pool.unpin(_key(1))
        assert pool.can_allocate() and pool.put(_key(4), 640, b"y" * 100) == (True, [_key(1)])
        assert pool.pinned_count() == 2
        for k in (_key(0), _key(3)):
            pool.unpin(k)


def test_too_big_is_refused_and_unpin_without_pin_is_a_bug():
    with SlotPool(100, 1) as pool:
        assert pool.put(_key(1), 128, bytes(101)) == (False, [])
        pool.put(_key(1), 128, bytes(100))
        with pytest.raises(AssertionError):
            pool.unpin(_key(1))


def test_concurrent_writers_and_readers_never_see_torn_or_wrong_bytes():
    size, n_keys = 4096, 64
    payload = {i: bytes([i % 251]) * size for i in range(n_keys)}
    errors: list[str] = []
    with SlotPool(size, 8) as pool:
        def writer(offset: int) -> None:
            for r in range(200):
                i = (r * 7 + offset) % n_keys
                pool.put(_key(i), 128 * (i + 1), payload[i])

        def reader() -> None:
            for r in range(400):
                i = r % n_keys
                p = pool.pin(_key(i))
                if p is None:
                    continue
                try:
                    if bytes(p.view) != payload[i] or checksum(p.view) != p.checksum:
                        errors.append(f"key {i}")
                finally:
                    p.view.release()
                    pool.unpin(_key(i))

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
        threads += [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(pool) == 8 and pool.pinned_count() == 0


def test_another_process_maps_the_pool_by_name_and_its_exit_leaves_the_segment():
    """`attach` in a subprocess reads the bytes; when it exits, the segment is still there (Python's
    resource tracker would unlink a plain SharedMemory(name) mapping at that process's exit)."""
    import subprocess
    import sys

    code = ("import sys; from kvledger.state.pool import attach\n"
            "shm = attach(sys.argv[1]); print(bytes(shm.buf[:64]).hex()); shm.close()\n")
    with SlotPool(1000, 2) as pool:
        data = os.urandom(1000)
        assert pool.put(_key(1), 128, data).stored
        for _ in range(2):  # a second process can attach after the first one left
            out = subprocess.run([sys.executable, "-c", code, pool.name], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert bytes.fromhex(out.stdout.strip()) == data[:64]
            assert "leaked" not in out.stderr and Path("/dev/shm", pool.name.lstrip("/")).exists()
        assert pool.get(_key(1)) == data


def test_an_extra_snapshot_goes_first_unless_a_read_promotes_it():
    """Rules 4′/4″: a checkpoint enters as the least recently used, so it never pushes out a chain's own window by
    being newer; once read (a conversation hit its system prompt's window) it is kept like any other."""
    evicted: list[bytes] = []
    with SlotPool(100, 2) as pool:
        pool.on_evict = evicted.extend
        pool.put(_key(0), 128, b"a" * 100)               # a prompt's own window
        pool.put(_key(1), 256, b"x" * 100, extra=True)   # a branch point's, newer
        assert pool.put(_key(2), 384, b"b" * 100) == (True, [_key(1)])   # the extra goes, not the older own one
        assert pool.get(_key(0)) is not None              # order, oldest first: 2, 0
        assert pool.put(_key(3), 512, b"y" * 100, extra=True) == (True, [_key(2)])   # enters oldest: 3, 0
        assert pool.get(_key(3)) is not None             # read: now the most recent (0, 3)
        assert pool.put(_key(4), 640, b"c" * 100) == (True, [_key(0)]) and evicted == [_key(1), _key(2), _key(0)]
