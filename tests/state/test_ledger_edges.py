"""Edges of StateLedger: races, faults that must be logged, and checks a mutation must not pass."""

import logging
import os
import threading

from kvledger.core import ModelSpec
from kvledger.state import MemoryDirectory, RedisDirectory, StateLedger
from kvledger.state.auth import derive_keys
from kvledger.state.directory import SnapshotEntry, sign
from kvledger.util.serve_process import free_port

SPEC = ModelSpec.preset("tiny-v4")
SIZE = SPEC.state_size_to_disk()
SLOT = -(-SIZE // 4096) * 4096  # the pool's page-aligned stride: capacity_bytes=SLOT holds one slot
TOKEN = "t0ken"
K1, K2, X = b"\x01" * 16, b"\x02" * 16, b"\x09" * 16


class GatedDirectory(MemoryDirectory):
    """A real MemoryDirectory whose publish of one key waits until the test opens the gate."""

    def __init__(self, held: bytes) -> None:
        super().__init__()
        self.held, self.waiting, self.gate = held, threading.Event(), threading.Event()

    def publish(self, entries: list[SnapshotEntry]) -> None:
        if any(e.key == self.held for e in entries):
            self.waiting.set()
            assert self.gate.wait(10)
        super().publish(entries)


def test_a_publish_racing_an_eviction_leaves_no_entry_behind():
    directory = GatedDirectory(held=K1)
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=SLOT) as ledger:  # one slot
        putter = threading.Thread(target=ledger.put, args=(K1, 128, os.urandom(SIZE)))
        putter.start()
        assert directory.waiting.wait(10)  # K1 is in the pool, its publish not yet in the directory
        assert ledger.put(K2, 128, os.urandom(SIZE))  # evicts K1: its withdraw comes before the publish
        assert K1 not in ledger.pool
        directory.gate.set()
        putter.join(10)
        assert directory.lookup([K1]) == [None]  # withdraw-after-publish won
        assert directory.lookup([K2])[0] is not None


def test_the_first_fault_of_each_kind_is_logged_with_its_traceback(caplog):
    dead = RedisDirectory(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)  # nothing listens
    ledger = StateLedger(SPEC, token=TOKEN, directory=dead, capacity_bytes=2 * SIZE, heartbeat=False)
    with caplog.at_level(logging.WARNING, logger="kvledger.state"), ledger:
        for i in range(3):
            ledger.put(bytes([i + 1]) * 16, 128, os.urandom(SIZE))
            assert ledger.positions([X]) == set()
    assert ledger.faults["directory"] >= 4 and ledger.faults["heartbeat"] == 1 and ledger.faults["retire"] == 1
    assert dead.faults == 3  # the lookups, answered "absent" by the directory itself
    records = [r for r in caplog.records if r.name.startswith("kvledger.state")]
    kinds = sorted(r.getMessage().split(": ", 1)[1].split()[0] for r in records)
    assert kinds == ["directory", "heartbeat", "lookup", "retire"]  # one record per kind, not one per fault
    assert all(r.levelno == logging.WARNING and r.exc_info and r.exc_info[0] is not None for r in records)


def test_positions_answer_only_where_the_snapshot_was_taken():
    """A key's snapshot is at (i + 1)·B for the i that key has in *this* prompt, not anywhere else."""
    directory = MemoryDirectory()
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=2 * SIZE) as holder, \
            StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=0) as entrypoint:
        assert holder.put(K1, 128, os.urandom(SIZE))
        for ledger in (holder, entrypoint):  # the pool path and the directory path
            assert ledger.positions([K1]) == {128}
            assert ledger.positions([X, K1]) == set()  # K1 at block 1 would end at 256: not a snapshot
            assert ledger.positions([X, K1], at={256}) == set()


def test_fetch_refuses_bytes_that_do_not_match_the_entry():
    """A pulled snapshot of another size or position than its (authentic but stale) entry is a miss."""
    directory = MemoryDirectory()
    dkey = derive_keys(TOKEN).directory
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=2 * SIZE) as holder, \
            StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=0) as entrypoint:
        short = os.urandom(SIZE - 100)
        assert holder.put(K1, 128, short)
        assert entrypoint.fetch(K1) == short
        for size, position in ((SIZE, 128), (SIZE - 200, 128), (SIZE - 100, 256)):
            directory.publish([sign(dkey, SnapshotEntry(K1, holder.holder, position, size, 0.0))])
            assert entrypoint.fetch(K1) is None, (size, position)
            assert entrypoint.fetch_into(K1, bytearray(SIZE)) is None, (size, position)


def test_the_server_limits_are_set_and_shown_on_the_ledger():
    """`max_connections`, `handshake_timeout_s`, `idle_timeout_s` reach the state server; silent
    connections past the cap do not keep another ledger from pulling."""
    import socket

    from kvledger.state.client import parse_address

    directory = MemoryDirectory()
    limits = {"max_connections": 2, "handshake_timeout_s": 0.3, "idle_timeout_s": 5.0}
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=2 * SIZE, **limits) as holder, \
            StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=0) as entrypoint:
        for name, value in limits.items():
            assert getattr(holder, name) == getattr(holder.server, name) == value
        data = os.urandom(SIZE)
        assert holder.put(K1, 128, data)
        silent = [socket.create_connection(parse_address(holder.address), timeout=5) for _ in range(6)]
        try:
            assert entrypoint.fetch(K1) == data
        finally:
            for s in silent:
                s.close()
