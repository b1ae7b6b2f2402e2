"""Forgetting a tenant on every node (DESIGN rule 12): `POST /admin/forget` → the receipt.

    receipt = await forget_tenant(state, "acme", hold_s=600)

Order, each step before the next:

    | step | where                            | what goes                                                       |
    |------|----------------------------------|-----------------------------------------------------------------|
    | 1    | this entrypoint (`Forgetting`)   | nothing yet: the tenant is held, so its requests from now on are |
    |      |                                  | served no-store, and those in flight keep no sample and no line |
    | 2    | every engine (`EngineClient`)    | device prefix cache keys, host pool snapshots, P/D tails, queued |
    |      |                                  | puts; its requests in flight store nothing more                 |
    | 3    | the block ledger (store/forget)  | a hold in the store, then blocks, tombstones, segment files,    |
    |      |                                  | snapshot files                                                  |
    | 4    | this entrypoint                  | the miss sample and the tenant's sites; the trace's lines       |

Step 2 before 3: what an engine still writes of the tenant is queued before the store removes anything, or is
dropped. The store's hold (step 3) refuses what an engine step 2 did not reach (down, or cut off) writes late; the
entrypoint's hold (step 1) keeps the tenant's requests no-store for as long, so nothing of it is kept anew until
both end (`hold_s` after the forget; 0: when it ends). A request arriving afterwards is the tenant's as before.

An engine that was down during the forget lost its pools and device cache with its process; it comes back empty,
and its directory entries name a dead incarnation (they read as absent). The receipt lists every engine the
registry named, with None for one that did not answer: what it holds was not removed.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvledger.core import tenant_of
from kvledger.store.ledger import blocks_dir

if TYPE_CHECKING:
    from kvledger.entrypoint.server_state import ServerState


@dataclass(slots=True)
class Forgetting:
    """The tenants this entrypoint holds, and when each was last forgotten. Times: time.perf_counter() seconds.
    Invariant: a tenant is held from the start of its forget until `hold_s` after its end."""

    held_until: dict[str, float] = field(default_factory=dict)
    forgotten_at: dict[str, float] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # one forget at a time

    def holds(self, namespace: str) -> bool:
        """Whether a request of `namespace` arriving now must be a no-store one: its tenant is held."""
        until = self.held_until.get(tenant_of(namespace))
        return until is not None and time.perf_counter() < until

    def keeps(self, namespace: str, arrival: float) -> bool:
        """Whether a request of `namespace` that arrived at `arrival` may leave its sample and trace line: no forget
        of its tenant began since."""
        at = self.forgotten_at.get(tenant_of(namespace))
        return at is None or arrival > at

    def begin(self, tenant: str) -> None:
        now = time.perf_counter()
        self.forgotten_at[tenant] = now
        self.held_until[tenant] = math.inf

    def end(self, tenant: str, hold_s: float) -> None:
        self.held_until[tenant] = time.perf_counter() + hold_s


async def forget_tenant(state: ServerState, tenant: str, hold_s: float) -> dict[str, Any]:
    """The module docstring's four steps for `tenant` (checked by the caller: `store.forget.check_tenant`); the
    receipt. Times in the receipt are epoch seconds."""
    forgetting = state.forgetting
    async with forgetting.lock:
        started = time.time()
        forgetting.begin(tenant)
        try:
            assert state.engine is not None
            engines = await state.engine.forget(tenant)
            root = blocks_dir(state.config.data_dir)
            store = await asyncio.to_thread(state.block_ledger.forget, tenant, hold_s=hold_s, root=root)
            prompts = state.misses.forget(tenant)
            lines = await asyncio.to_thread(state.trace.forget, tenant)
        finally:
            forgetting.end(tenant, hold_s)
    return {"object": "forget.receipt", "namespace": tenant, "started_at": started, "finished_at": time.time(),
            "held_until": time.time() + hold_s if hold_s > 0 else None,
            "store": store.receipt(), "engines": engines,
            "unreached": sorted(engine for engine, got in engines.items() if got is None),
            "entrypoint": {"sample_prompts": prompts, "trace_lines": lines}}
