"""A Redis URL's password never leaves the process that was given it: logs, errors and stats print the URL
without its credentials (an outside run found `redis://:PASSWORD@…` in every engine's log after a Redis fault)."""

from __future__ import annotations

import logging

from kvledger.store.ledger import BlockLedger
from kvledger.util.redis_client import shown_url
from kvledger.util.redis_server import RedisServer

from .conftest import chain

PASSWORD = "pw-0123456789abcdef"


def test_shown_url_drops_credentials_only():
    assert shown_url(f"redis://:{PASSWORD}@127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert shown_url(f"redis://user:{PASSWORD}@h:1/2") == "redis://h:1/2"
    assert shown_url(f"redis+cluster://:{PASSWORD}@a:1,b:2") == "redis+cluster://a:1,b:2"
    assert shown_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert shown_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_store_logs_and_stats_never_show_the_password(tmp_path, caplog):
    server = RedisServer(password=PASSWORD).start()
    try:
        ledger = BlockLedger.open(path=tmp_path, redis_url=server.url)
        keys, blocks = chain(2)
        ledger.put_chain(keys, blocks)
        assert PASSWORD not in ledger.stats().location
    finally:
        server.kill()
    with caplog.at_level(logging.WARNING, logger="kvledger.store"):
        assert ledger.match(keys) == 0                       # Redis is gone: a miss, logged
        assert ledger.put_chain(keys, blocks).failed == 2   # and a failed put, logged
    assert "failed" in caplog.text and "127.0.0.1" in caplog.text
    assert PASSWORD not in caplog.text
    ledger.close()
