"""TTL refresh off the CHECK path: hits are noted in memory and written by a background thread.

A CHECK that matched a prefix notes (segment id → new expiry, last hit) for the segments of
that prefix; it never takes the index's write lock itself. The thread wakes on the first note,
merges whatever accumulated while it wrote the previous batch, and writes it in one
transaction (only ever moving times forward). Other processes see a refresh once that
transaction commits: within one write of the index (milliseconds; at most the longest write
transaction of another process, one GC batch) after the CHECK. This process sees it at once:
`expiry()` consults the notes, written or not (a read snapshot older than the commit would miss them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvledger.store")

WRITTEN_KEPT = 1 << 20   # segment ids whose written refresh this process remembers (values only move forward)
Writer = Callable[[dict[int, tuple[float, float]]], None]


class Refresher:
    """Pending refreshes of one process and the thread that writes them (started on the first note)."""

    def __init__(self, write: Writer) -> None:
        self._write = write
        self._lock = threading.Lock()          # guards the two dicts
        self._write_lock = threading.Lock()    # one writer of notes at a time (thread or flush)
        self._pending: dict[int, tuple[float, float]] = {}
        self._inflight: dict[int, tuple[float, float]] = {}
        # written notes stay readable: a read snapshot taken before their commit must still see them
        self._written: dict[int, float] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def note(self, times: dict[int, tuple[float, float]]) -> None:
        """Refresh these segments to at least (expiry, last hit)."""
        if not times:
            return
        with self._lock:
            for seg_id, (exp, hit) in times.items():
                old = self._pending.get(seg_id)
                self._pending[seg_id] = (exp, hit) if old is None else (max(old[0], exp), max(old[1], hit))
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._run, name="kvledger-refresh", daemon=True)
                self._thread.start()
        self._wake.set()

    def expiry(self, seg_id: int) -> float:
        """The expiry noted for a segment and not yet written (0 when none)."""
        a, b = self._pending.get(seg_id), self._inflight.get(seg_id)
        return max(a[0] if a else 0.0, b[0] if b else 0.0, self._written.get(seg_id, 0.0))

    def flush(self) -> None:
        """Write every note now (in the caller's thread)."""
        with self._write_lock:
            with self._lock:
                batch = self._inflight = self._pending   # readers see a note in one dict or the other
                self._pending = {}
            if batch:
                try:
                    self._write(batch)
                except Exception as e:  # a failed refresh shortens a block's life, never serves wrong bytes
                    log.warning("TTL refresh of %d segments failed: %s", len(batch), e)
            with self._lock:
                if len(self._written) > WRITTEN_KEPT:
                    self._written = {}
                for seg_id, (exp, _) in batch.items():
                    self._written[seg_id] = max(exp, self._written.get(seg_id, 0.0))
                self._inflight = {}

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait()
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()
