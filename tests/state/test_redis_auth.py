"""The directory on a Redis that wants a password (`requirepass`, an ACL user), and on a hung one."""

import os
import signal
import time
import uuid

import pytest
import redis

from kvledger.core import ModelSpec
from kvledger.state import RedisDirectory, StateLedger
from kvledger.util.redis_server import RedisServer

SPEC = ModelSpec.preset("tiny-v4")
SIZE = SPEC.state_size_to_disk()
SLOT = -(-SIZE // 4096) * 4096
TOKEN = "t0ken"


@pytest.fixture(scope="module")
def locked_redis():
    """A redis-server with `requirepass` and one ACL user limited to the kvl:* keys."""
    server = RedisServer(password=uuid.uuid4().hex).start(timeout_s=60)  # a loaded machine starts it slowly
    try:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser("kvl", enabled=True, passwords=["+kvl-secret"], keys=["kvl:*"], commands=["+@all"])
        admin.close()
        yield server
    finally:
        server.close()


def _two_ledgers_share_a_snapshot(url: str) -> None:
    prefix = f"kvl:test:{uuid.uuid4().hex[:8]}:"
    mk = lambda cap: StateLedger(SPEC, token=TOKEN, capacity_bytes=cap,  # noqa: E731
                                 directory=RedisDirectory(url, prefix=prefix, socket_timeout_s=1.0))
    with mk(2 * SLOT) as holder, mk(0) as entrypoint:
        data = os.urandom(SIZE)
        assert holder.put(b"\x01" * 16, 128, data)
        assert entrypoint.positions([b"\x01" * 16]) == {128} and entrypoint.fetch(b"\x01" * 16) == data
        assert holder.faults == {} and entrypoint.faults == {}


def test_requirepass_in_the_url(locked_redis):
    port = locked_redis.port
    _two_ledgers_share_a_snapshot(f"redis://:{locked_redis.password}@127.0.0.1:{port}/0")


def test_an_acl_user_in_the_url(locked_redis):
    _two_ledgers_share_a_snapshot(f"redis://kvl:kvl-secret@127.0.0.1:{locked_redis.port}/0")


def test_a_wrong_or_missing_password_is_a_miss_not_an_error(locked_redis):
    for url in (f"redis://127.0.0.1:{locked_redis.port}/0", f"redis://kvl:wrong@127.0.0.1:{locked_redis.port}/0"):
        with StateLedger(SPEC, token=TOKEN, capacity_bytes=SLOT, directory=RedisDirectory(url)) as ledger:
            assert ledger.put(b"\x01" * 16, 128, os.urandom(SIZE))  # kept in the pool
            assert ledger.faults["directory"] >= 1 and ledger.faults["heartbeat"] >= 1
            assert ledger.directory.lookup([b"\x02" * 16]) == [None] and ledger.directory.faults == 1


def test_a_hung_redis_costs_one_deadline_per_operation():
    """SIGSTOPped Redis: a put (evict → withdraw, publish, re-check) and a lookup each return within
    one deadline, on a kept connection and on a new one that must first AUTH."""
    server = RedisServer(password="pw").start(timeout_s=60)
    try:
        url, timeout = server.url, 1.0
        with StateLedger(SPEC, token=TOKEN, capacity_bytes=SLOT, heartbeat=False, directory_timeout_s=timeout,
                         directory=RedisDirectory(url, socket_timeout_s=timeout)) as ledger:
            assert ledger.put(b"\x01" * 16, 128, os.urandom(SIZE)) and ledger.faults == {}
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert ledger.put(b"\x02" * 16, 128, os.urandom(SIZE))  # evicts the first: two directory ops
                put_s = time.monotonic() - t0
                fresh = RedisDirectory(url, socket_timeout_s=timeout)  # connect + AUTH + script, all hung
                t0 = time.monotonic()
                assert fresh.lookup([b"\x01" * 16]) == [None]
                lookup_s = time.monotonic() - t0
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert ledger.faults["directory"] >= 1 and fresh.faults == 1
            assert timeout * 0.9 < put_s < 1.7 * timeout, put_s  # one deadline, not one per round trip
            assert timeout * 0.9 < lookup_s < 1.7 * timeout, lookup_s
    finally:
        server.close()
