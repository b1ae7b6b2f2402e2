"""The vLLM connector's files are its user's alone whatever vLLM's umask, and its event log names no salt
(issue 54 item 4).

vLLM does not run under `kvledger`'s umask 077. Under a shell's 022 the connector's folders were 0755 and
segments/*.kvs, index.lmdb and events.jsonl 0644 (any local user read the cached KV), and events.jsonl carried each
request's cache_salt, its namespace, in clear. Here the connector's worker side of a hybrid model saves a salted
request's blocks and its window the way vLLM drives it (real ledgers on disk, no vLLM), under umask 022, and
loads them back; then every path under the store and the log's folder is checked, and the log is read."""

from __future__ import annotations

import json

import torch

from kvledger.integrations.vllm.config import ConnectorConfig, shared_state_ledger
from kvledger.integrations.vllm.events import EVENTS_KEY, event_log
from kvledger.integrations.vllm.layout import KvLayout
from kvledger.integrations.vllm.scheduler import SchedulerSide
from kvledger.integrations.vllm.worker import WorkerSide
from kvledger.store.ledger import BlockLedger
from tests.entrypoint.test_private_files import exposed, umask
from tests.integrations.test_vllm_hybrid_sides import (GEOMETRY, GROUPS, NAMES, NUM_BLOCKS, SPEC, _new, caches, forward,
                                                       ids)
from tests.integrations.test_vllm_sides import B, request, step

SALT = "tenant-7f3a-secret-salt"


def worker(config: ConnectorConfig, ledger: BlockLedger, kv: dict[str, torch.Tensor]) -> WorkerSide:
    """The worker side as the connector builds it (its event log from `config`), for the hybrid test model."""
    side = WorkerSide(ledger, event_log(config), shared_state_ledger(config, SPEC))
    layer_bytes = B * GEOMETRY.layer_token_bytes
    side.register(KvLayout({NAMES[1]: kv[NAMES[1]]}, NUM_BLOCKS, layer_bytes),
                  KvLayout({NAMES[0]: kv[NAMES[0]], NAMES[2]: kv[NAMES[2]]}, NUM_BLOCKS, layer_bytes),
                  {NAMES[0]: 0, NAMES[2]: 1})
    return side


def test_the_connector_under_umask_022_writes_a_private_store_and_no_salt(tmp_path):
    store, logs = tmp_path / "store", tmp_path / "logs"
    logs.mkdir(mode=0o700)
    config = ConnectorConfig.from_extra({"path": str(store), "fsync": False, "events": str(logs / "events.jsonl")})
    with umask(0o022), BlockLedger.open(config.path, fsync=False) as ledger:
        state = shared_state_ledger(config, SPEC)
        cold = SchedulerSide(ledger, SPEC, state=state, groups=GROUPS)
        req = request("r", 700, salt=SALT)                 # 5 blocks and the window at 640 saved
        cold.after_alloc(req, 0)
        assert forward(worker(config, ledger, caches(1)), cold.plan_step(_new(req, 0, 700))) == (set(), set())
        side = SchedulerSide(ledger, SPEC, state=state, groups=GROUPS)
        again = request("s", 700, salt=SALT)
        assert side.matched_tokens(again, 0) == 5 * B      # its namespace hits what it saved
        side.after_alloc(again, 5 * B, (ids(40), ids(50), ids(60)))
        assert forward(worker(config, ledger, caches(2)), side.plan_step(step())) == ({"s"}, set())
    written = {p.name for p in store.rglob("*")}
    assert {"index.lmdb", "data.mdb", "lock.mdb", ".lock", EVENTS_KEY} <= written, written
    assert any(p.suffix == ".kvs" for p in store.rglob("*")) and any(p.suffix == ".snap" for p in store.rglob("*"))
    assert exposed(store) == [] and exposed(logs) == []
    text = (logs / "events.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    assert {e["event"] for e in lines} == {"save", "window_save", "load", "window_load"}
    assert SALT not in text and SALT.encode().hex() not in text
    digests = {e["namespace_digest"] for e in lines if "start" in e}
    assert len(digests) == 1 and len(digests.pop()) == 16      # one namespace, its lines still group
