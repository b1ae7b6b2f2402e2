"""The connector's event log (`events` in kv_connector_extra_config): one JSON line per block load, failed load
and save, and per window load and save, for operators and the benches (`bench.load_events`, `hybrid_bench`).

    {"event": "save", "req_id": "r", "namespace_digest": "<16 hex>", "start": 0, "blocks": 5, "ok": 5,
     "seconds": 0.0013, "t": 1796645356.48}

Private whatever vLLM's umask. The file is created 0600 (`private_file.open_private`). A request's namespace is its
`cache_salt` (a tenant's own secret, and the name of its cached blocks), so it is never written: `namespace_digest`
is the first 8 bytes, in hex, of HMAC-SHA256 of it under the store's events key, `<path>/events.key` (32 random
bytes, 0600, made on first use and shared by every worker of the store: `claim_secret`). One namespace's lines
still group, across workers and restarts; without the key nobody can test a guessed salt against them. A store
without a folder (`redis_url` alone) keys them with a key of this process: its lines group within it only.

No vLLM import here: the main test suite reads this module.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

from kvledger.integrations.vllm.config import ConnectorConfig
from kvledger.util.private_file import claim_secret, open_private

EVENTS_KEY = "events.key"   # in the store's folder
DIGEST_BYTES = 8            # of a namespace's HMAC: 16 hex characters, a collision between 2^32 namespaces


class EventLog:
    """Appends lines to `path`, one `write` per line on an O_APPEND descriptor (the workers of one vLLM may share
    the file); `key` is the events key (≥ 16 bytes) that `digest` keys namespaces with."""

    def __init__(self, path: str | Path, key: bytes) -> None:
        assert len(key) >= 16, "an events key of at least 128 bits"
        self.path, self._key = Path(path), key

    def digest(self, namespace: str) -> str:
        """What a line says of `namespace`: HMAC-SHA256 under the events key, its first DIGEST_BYTES, hex."""
        return hmac.digest(self._key, namespace.encode(), "sha256")[:DIGEST_BYTES].hex()

    def write(self, fields: dict[str, object]) -> None:
        """One line of `fields` (JSON; the caller never puts a namespace in them, only its `digest`)."""
        fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (json.dumps(fields) + "\n").encode())
        finally:
            os.close(fd)


def event_log(config: ConnectorConfig) -> EventLog | None:
    """The event log `config` asks for (None without `events`), keyed by its store's events key."""
    if not config.events:
        return None
    key = claim_secret(Path(config.path) / EVENTS_KEY, "events key") if config.path else secrets.token_bytes(32)
    return EventLog(config.events, key)
