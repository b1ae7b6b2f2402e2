"""Forgetting a tenant in the block ledger (DESIGN rule 12, issue 54 item 3), on every backend: its blocks (its
salted namespaces' too), its tombstones (of blocks gone before the forget too), its files on the mount and its
snapshot files go; a hold refuses its late writes; another tenant keeps everything. And `kvledger store forget` on
a stopped store, embedded and on Redis."""

from __future__ import annotations

import json
import os
import time

import pytest

from kvledger.core import salted_namespace
from kvledger.core.attribution import MissCause
from kvledger.store.backend import ChainWrite, Match
from kvledger.store.forget import check_tenant, forget_store, tenant_tag
from kvledger.store.ledger import BlockLedger
from kvledger.store.lmdb_store import LmdbStore

from .conftest import BLOCK, block_of, chain

SALTED = salted_namespace("acme", "s1")


def fill(led: BlockLedger) -> dict[str, list[bytes]]:
    """acme: 6 blocks, 2 of them deleted (tombstones); acme's salted namespace: 3; acmeX (a longer name, another
    tenant): 2; other: 4, 1 deleted. The keys of each."""
    keys = {"acme": chain(6, "acme", 1)[0], SALTED: chain(3, SALTED, 2)[0], "acmeX": chain(2, "acmeX", 3)[0],
            "other": chain(4, "other", 4)[0]}
    for ns, ks in keys.items():
        assert led.put_chain(ks, [block_of(k) for k in ks], namespace=ns).written == len(ks)
    assert led.delete(keys["acme"][4:]) == 2 and led.delete(keys["other"][3:]) == 1
    return keys


def test_forget_takes_every_block_and_tombstone_of_a_tenant_and_nothing_of_another(store):
    led = BlockLedger(store)
    keys = fill(led)
    assert led.match_explained(keys["acme"]).gone is not None or led.match(keys["acme"]) == 4   # a tombstone at 4
    redis = getattr(store, "url", None) is not None
    if redis:   # one of acme's blocks gone as Redis's own expiry removes one: no script runs, its bytes stay counted
        from kvledger.util.redis_fanout import Call, command

        k = keys["acme"][3]
        assert store.nodes.run([Call(store.place.slot(k), command("DEL", store.place.name(k)))]) == [1]
    assert led.stats().namespace_bytes["acme"] == 7 * BLOCK   # 4 + 3 salted (acme's); on Redis the gone one too
    got = led.forget("acme", hold_s=60)
    # on Redis the block gone by expiry left its tombstone (tagged acme): found among the tombstones
    assert (got.blocks, got.bytes, got.tombstones, got.faults) == (7 - redis, (7 - redis) * BLOCK, 2 + redis, 0)
    assert set(got.keys) == set(keys["acme"]) | set(keys[SALTED]) and got.held_until > time.time() + 50
    assert led.stats().namespace_bytes == {"acmeX": 2 * BLOCK, "other": 3 * BLOCK}   # no quota bucket of acme left
    # nothing of acme answers: no block, and no tombstone to say "evicted" (its next request is cold)
    assert led.match_explained(keys["acme"]) == Match(0, None) and led.match_explained(keys[SALTED]) == Match(0, None)
    assert led.match_explained(keys["acme"][4:]) == Match(0, None)
    assert led.exists(keys["acme"] + keys[SALTED]) == [False] * 9
    assert {ns for ns in led.stats().per_namespace} == {"acmeX", "other"}
    assert led.stats().per_namespace == {"acmeX": 2, "other": 3}
    assert led.match(keys["acmeX"]) == 2 and led.match(keys["other"]) == 3
    assert led.match_explained(keys["other"]).gone.cause is MissCause.EVICTED   # other's tombstone stays
    shared = getattr(store, "url", None) is not None and store.files is not None   # the cluster mode's mount
    assert got.files == (0 if getattr(store, "url", None) is not None and not shared else 2)   # one file a put
    if shared:
        assert {b.namespace for b in store.files.blocks()} == {"acmeX", "other"}
    # the hold: a late write of acme (or of a salted namespace of it) is refused, another tenant's is not
    assert led.put_chain(keys["acme"], [block_of(k) for k in keys["acme"]], namespace="acme").written == 0
    assert led.put_chain(keys[SALTED], [block_of(k) for k in keys[SALTED]], namespace=SALTED).written == 0
    assert store.counters.blocks_refused == 9 and led.match(keys["acme"]) == 0
    assert led.put_chain(keys["other"][3:], [block_of(keys["other"][3])], namespace="other", start_pos=3,
                         parent=keys["other"][2]).written == 1


def test_the_hold_ends_and_no_hold_holds_nothing(store):
    led = BlockLedger(store)
    keys, blocks = chain(3, "acme", 5)
    got = led.forget("acme", hold_s=0.5)
    assert got.blocks == 0 and led.put_chain(keys, blocks, namespace="acme").written == 0
    time.sleep(0.7)
    assert led.put_chain(keys, blocks, namespace="acme").written == 3
    got = led.forget("acme", hold_s=0)
    assert got.blocks == 3 and got.held_until is None
    assert led.put_chain(keys, blocks, namespace="acme").written == 3


def test_tombstones_of_expired_blocks_carry_their_tenant(tmp_path, clock, shared_redis):
    """A block that expired before the forget left a tombstone (GC's on LMDB, Redis's own expiry on Redis): the
    forget finds it by its tenant tag, though no record of the block is left."""
    from kvledger.store.redis_backend import RedisStore

    a, b = chain(3, "acme", 6), chain(2, "other", 7)
    with LmdbStore(tmp_path, fsync=False, clock=clock) as lmdb_store, \
            RedisStore(shared_redis.url, prefix=f"exp{os.getpid()}:") as redis_store:
        for st in (lmdb_store, redis_store):
            for (keys, blocks), ns in ((a, "acme"), (b, "other")):
                st.put(ChainWrite(keys, blocks, 0, bytes(16), ns, "agent", 0.3))
        clock.advance(1)
        time.sleep(0.5)
        assert lmdb_store.gc().expired == 5
        for st in (lmdb_store, redis_store):
            assert st.match_explained(a[0], 100).gone.cause is MissCause.EXPIRED
            got = st.forget("acme", 0)
            assert (got.blocks, got.tombstones) == (0, 3)
            assert st.match_explained(a[0], 100) == Match(0, None)
            assert st.match_explained(b[0], 100).gone.cause is MissCause.EXPIRED


def test_snapshot_files_of_the_tenant_go_and_orphans_with_them(tmp_path):
    """Snapshot files record no namespace; their keys are the chain keys of blocks: those of the tenant's blocks and
    tombstones go. A file whose block no index holds (an orphan, older than GC's grace) goes as `store gc` takes it."""
    from kvledger.state.files import SnapshotFiles

    with BlockLedger.open(path=tmp_path, fsync=False) as led:
        keys = fill(led)
        files = SnapshotFiles(tmp_path)
        for k in (keys["acme"][1], keys["acme"][4], keys[SALTED][2], keys["other"][1], b"\x01" * 16):
            files.write(k, 128, b"window")
        old = time.time() - 3600
        os.utime(files.path(b"\x01" * 16), (old, old))
        got = forget_store(led.store, "acme", hold_s=0, root=tmp_path)
        assert (got.snapshot_files, got.orphan_snapshot_files) == (3, 1)
        assert files.exists(keys["other"][1]) and not files.exists(keys["acme"][1])


def test_a_tenant_name_is_checked():
    assert check_tenant("acme") == "acme"
    for bad in ("", None, SALTED, "x" * 1000):
        with pytest.raises(ValueError):
            check_tenant(bad)
    assert tenant_tag(SALTED) == tenant_tag("acme") != tenant_tag("acmeX")


# --- the command, on a stopped store ----------------------------------------------------------------------


def test_store_forget_on_a_stopped_embedded_store(run_cli, tmp_path):
    data = tmp_path / "data"
    with BlockLedger.open(path=data / "blocks", fsync=False) as led:
        keys = fill(led)
    got = run_cli("store", "forget", "--path", str(data), "--namespace", "acme", "--hold-s", "0", "--json")
    assert got.returncode == 0, got.stderr
    receipt = json.loads(got.stdout)
    assert receipt["namespace"] == "acme" and receipt["store"]["blocks"] == 7 and receipt["store"]["tombstones"] == 2
    assert receipt["store"]["held_until"] is None
    stats = json.loads(run_cli("store", "stats", "--path", str(data), "--json").stdout)
    assert stats["per_namespace"] == {"acmeX": 2, "other": 3}
    with BlockLedger.open(path=data / "blocks", fsync=False) as led:
        assert led.match_explained(keys["acme"]) == Match(0, None)
    text = run_cli("store", "forget", "--path", str(data), "--namespace", "other")
    assert text.returncode == 0 and "blocks" in text.stdout and "held_until" in text.stdout


def test_store_forget_on_redis_and_on_the_cluster_mode(run_cli, tmp_path, redis_server):
    from kvledger.store.redis_backend import RedisStore
    from kvledger.store.shared_files import SharedFiles

    with RedisStore(redis_server.url, prefix="kvl:") as st:
        keys = fill(BlockLedger(st))
    got = run_cli("store", "forget", "--redis-url", redis_server.url, "--namespace", "acme", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["store"] | {"held_until": 0} == {
        "blocks": 7, "bytes": 7 * BLOCK, "files": 0, "tombstones": 2, "snapshot_files": 0,
        "orphan_snapshot_files": 0, "held_until": 0, "faults": 0}
    with RedisStore(redis_server.url, prefix="kvl:") as st:
        assert BlockLedger(st).match(keys["acme"]) == 0 and BlockLedger(st).match(keys["other"]) == 3
        st.nodes.client().flushall()
    mount = tmp_path / "mount"
    mount.mkdir()
    with RedisStore(redis_server.url, prefix="kvl:", files=SharedFiles(mount, fsync=False)) as st:
        fill(BlockLedger(st))
    got = run_cli("store", "forget", "--redis-url", redis_server.url, "--path", str(mount), "--namespace", "acme",
                  "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["store"]["files"] == 2


@pytest.mark.parametrize("args, says", [
    (["--namespace", SALTED], "salted namespace"), (["--namespace", ""], "--namespace"),
    (["--namespace", "acme", "--hold-s", "-1"], "--hold-s"), ([], "--namespace"),
])
def test_store_forget_refuses_bad_input_in_one_line(run_cli, tmp_path, args, says):
    data = tmp_path / "data"
    BlockLedger.open(path=data / "blocks", fsync=False).close()
    got = run_cli("store", "forget", "--path", str(data), *args)
    assert got.returncode == 2 and says in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
