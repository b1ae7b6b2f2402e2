"""Hostile users of the state ledger: a Redis writer without the token, an empty token,
another tenant's prompt. Each ends in a miss, never in someone else's bytes."""

import os
import socket
import threading
import uuid

import pytest

from kvledger.core import ModelSpec, chain_keys
from kvledger.state import RedisDirectory, StateLedger
from kvledger.state.directory import Holder, SnapshotEntry
from kvledger.state.redis_directory import encode_entry

SPEC = ModelSpec.preset("tiny-v4")
SIZE = SPEC.state_size_to_disk()
TOKEN = "t0ken"


class Listener:
    """A would-be attacker's server: counts connections and records every byte it is sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.accepted = 0
        self.received = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(0.5)
                try:
                    while chunk := conn.recv(1 << 16):
                        self.received += chunk
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def _forge(directory: RedisDirectory, key: bytes, entry: SnapshotEntry) -> None:
    """Write an entry and its holder's liveness record straight into Redis, as a writer without the token can."""
    directory._r.set(directory._snap(key), encode_entry(entry))
    directory._r.set(directory._live(entry.holder.engine_id), entry.holder.incarnation)


def test_forged_and_moved_directory_entries_read_as_absent(shared_redis):
    prefix = f"kvl:test:{uuid.uuid4().hex[:8]}:"
    attacker = Listener()
    mk = lambda **kw: StateLedger(SPEC, token=TOKEN, directory=RedisDirectory(shared_redis.url, prefix=prefix), **kw)  # noqa: E731
    try:
        with mk(capacity_bytes=4 * SIZE, engine_id="a") as a, mk(capacity_bytes=0) as e:
            genuine, forged = b"\x01" * 16, b"\x02" * 16
            data = os.urandom(SIZE)
            assert a.put(genuine, 128, data)
            (entry,) = e.directory.lookup([genuine])
            assert e.positions([genuine]) == {128} and e.fetch(genuine) == data
            evil = Holder("evil", attacker.address)
            _forge(e.directory, forged, SnapshotEntry(forged, evil, 128, SIZE, 0.0))  # unsigned
            _forge(e.directory, b"\x03" * 16, SnapshotEntry(b"\x03" * 16, evil, 128, SIZE, 0.0, os.urandom(32)))
            # a genuine entry's MAC, moved to the attacker's address (same engine and incarnation)
            _forge(e.directory, genuine, SnapshotEntry(genuine, Holder("a", attacker.address, entry.holder.incarnation),
                                                       128, SIZE, 0.0, entry.mac))
            for key in (forged, b"\x03" * 16, genuine):
                assert e.directory.lookup([key])[0] is not None  # the forgery is in Redis ...
                assert e.positions([key]) == set() and e.fetch(key) is None  # ... and reads as absent
                assert e.fetch_into(key, bytearray(SIZE)) is None
        assert attacker.accepted == 0 and attacker.received == b""  # nobody even called it
    finally:
        attacker.close()


def test_an_empty_token_is_refused_at_start():
    for token in ("", b""):
        with pytest.raises(ValueError, match="token is empty"):
            StateLedger(SPEC, token=token, capacity_bytes=0)


def test_two_namespaces_never_share_a_snapshot():
    """The same prompt in two tenants' namespaces: a snapshot put under one is absent under the other."""
    tokens = list(range(1000))
    mine, theirs = chain_keys(tokens, SPEC, namespace="tenant-a"), chain_keys(tokens, SPEC, namespace="tenant-b")
    assert not set(mine) & set(theirs)
    from kvledger.state import MemoryDirectory

    directory = MemoryDirectory()
    with StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=4 * SIZE) as holder, \
            StateLedger(SPEC, token=TOKEN, directory=directory, capacity_bytes=0) as entrypoint:
        data = os.urandom(SIZE)
        assert holder.put(mine[6], 896, data)
        for ledger in (holder, entrypoint):
            assert ledger.positions(mine) == {896} and ledger.fetch(mine[6]) == data
            assert ledger.positions(theirs) == set() and ledger.positions(theirs, at={896}) == set()
            assert all(ledger.fetch(k) is None for k in theirs)
