"""The one place a process opens its two ledgers, by its part in the house.

    ledgers = open_ledgers(spec, data_dir, Part.EMBEDDED)                             # `kvledger serve`
    ledgers = open_ledgers(spec, data_dir, Part.ENTRYPOINT, redis_url=url, token=t)  # `kvledger entrypoint`
    ledgers = open_ledgers(spec, data_dir, Part.ENGINE, redis_url=url, token=t, engine_id="prefill-0")

| part       | block ledger                            | state ledger (models with sliding-window layers)      |
|------------|-----------------------------------------|--------------------------------------------------------|
| embedded   | `<data_dir>/blocks` (segments + LMDB,   | this process's pool, snapshots also on disk beside the |
|            | its index pinned in memory)             | blocks (a restart keeps exact hits), no state server  |
| entrypoint | Redis index, segment files on the mount | the Redis directory only: it holds no snapshot (CHECK) |
| engine     | Redis index, segment files on the mount | its own pool and state server, the Redis directory     |
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvledger.core import ModelSpec
from kvledger.engine.defaults import DEFAULTS
from kvledger.state.ledger import StateLedger
from kvledger.store.ledger import BlockLedger, blocks_dir
from kvledger.store.quota import Quotas
from kvledger.store.ttl import TtlPolicy


class Part(StrEnum):
    EMBEDDED = "embedded"
    ENTRYPOINT = "entrypoint"
    ENGINE = "engine"


@dataclass(slots=True)
class Ledgers:
    block: BlockLedger
    state: StateLedger | None   # None for a model without sliding-window layers

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
        self.block.close()


def open_ledgers(spec: ModelSpec, data_dir: Path, part: Part, *, redis_url: str | None = None,
                 token: str | None = None, engine_id: str | None = None, host: str = DEFAULTS.host,
                 policy: TtlPolicy | None = None, capacity_bytes: int | None = None,
                 quotas: Quotas | None = None) -> Ledgers:
    """Both ledgers of a process playing `part` (the module's table). The cluster parts need `redis_url` and
    the cluster `token` (the state server's and the directory's keys derive from it); the engine its id.
    `capacity_bytes`: the block ledger's limit (least recently hit blocks evicted past it), `quotas` the
    guarantees kept in it (store/quota.py; None: those the store records). The embedded server pins its LMDB
    index in memory (store/index_pin.py): it is the node's one long-lived process."""
    assert (part is Part.EMBEDDED) == (redis_url is None) == (token is None), "the cluster parts need both"
    assert (part is Part.ENGINE) == (engine_id is not None), "an engine is named in the directory"
    block = BlockLedger.open(path=blocks_dir(data_dir), redis_url=redis_url, policy=policy,
                             capacity_bytes=capacity_bytes, quotas=quotas, pin_index=part is Part.EMBEDDED)
    try:
        return Ledgers(block, _state_ledger(spec, data_dir, part, redis_url, token, engine_id, host))
    except BaseException:
        block.close()
        raise


def _state_ledger(spec: ModelSpec, data_dir: Path, part: Part, redis_url: str | None, token: str | None,
                  engine_id: str | None, host: str) -> StateLedger | None:
    if not spec.has_swa:
        return None
    if part is Part.EMBEDDED:
        return StateLedger(spec, token=secrets.token_hex(16), strategy="full", root=blocks_dir(data_dir),
                           serve=False, heartbeat=False).start()
    from kvledger.state.redis_directory import RedisDirectory

    assert redis_url is not None and token is not None
    if part is Part.ENTRYPOINT:
        return StateLedger(spec, token=token, directory=RedisDirectory(redis_url), capacity_bytes=0,
                           serve=False, heartbeat=False).start()
    return StateLedger(spec, token=token, directory=RedisDirectory(redis_url), engine_id=engine_id,
                       host=host).start()
