"""The embedded server's block-ledger upkeep while it serves: `BlockLedger.gc()` every `interval_s` seconds.

gc removes expired blocks (their TTL ran out: a CHECK already treats them as absent, so this frees their
bytes, and their share of `--store-capacity`) and evicts down to the capacity; a put past the capacity
evicts at once by itself (store/lmdb_gc.py `make_room`). gc works in short batches that leave the writer
lock free between them, so requests' CHECKs and puts go on meanwhile. A failing gc is logged by the
store and tried again at the next tick.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("kvledger.serve")


class PeriodicGc:
    """A daemon thread calling `ledger.gc()` every `interval_s` seconds (> 0) until `stop()`."""

    def __init__(self, ledger: Any, interval_s: float) -> None:
        assert interval_s > 0
        self.ledger, self.interval_s = ledger, interval_s
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-gc", daemon=True)

    def start(self) -> PeriodicGc:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.ledger.gc()
            except Exception as e:   # the store absorbs its faults; anything else is logged, never fatal
                log.warning("store gc failed: %s: %s", type(e).__name__, e)
            self.runs += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
