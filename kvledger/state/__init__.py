"""The state ledger: sliding-window snapshots in host memory, a directory, pulls between machines.

  pool.py       fixed-size snapshot slots in one shared-memory segment, LRU, pin/unpin
  directory.py  key → holder, position, size, time (MACed); MemoryDirectory (embedded)
  redis_directory.py  RedisDirectory (shared), one deadline per operation
  auth.py       keys and MACs derived from the cluster token (never sent)
  wire.py       the binary wire format of the state server (no pickle)
  handshake.py  the connection handshake, both sides
  pull_server.py  the state server (a thread per connection), serving snapshots out of the pool
  client.py     pulls (a fault is a miss, never an exception)
  files.py      checksummed, atomically written snapshot files (strategies `full`, `periodic:N`)
  strategy.py   memory | full | periodic:N | zero
  ledger.py     StateLedger: put / positions / fetch, what engines and the entrypoint use
"""

from kvledger.state.client import StateClient, pull
from kvledger.state.directory import Directory, Holder, MemoryDirectory, SnapshotEntry
from kvledger.state.redis_directory import RedisDirectory
from kvledger.state.files import SnapshotFiles
from kvledger.state.ledger import StateLedger
from kvledger.state.pool import SlotPool
from kvledger.state.pull_server import StateServer
from kvledger.state.strategy import Strategy, StrategyKind

__all__ = [
    "Directory", "Holder", "MemoryDirectory", "RedisDirectory", "SlotPool", "SnapshotEntry", "SnapshotFiles",
    "StateClient", "StateLedger", "StateServer", "Strategy", "StrategyKind", "pull",
]
