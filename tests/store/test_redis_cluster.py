"""Redis Cluster: the launcher, the redis+cluster:// URL, and why the keys must travel in KEYS."""

from __future__ import annotations

import pytest

from kvledger.util.redis_cluster import ClusterUrl, cluster_client, parse_cluster_url


def test_cluster_url_parses_nodes_and_credentials():
    assert parse_cluster_url("redis+cluster://127.0.0.1:7000") == ClusterUrl((("127.0.0.1", 7000),))
    assert parse_cluster_url("redis+cluster://u:p%40ss@a:1,b:2/0") == ClusterUrl((("a", 1), ("b", 2)), "u", "p@ss")
    assert parse_cluster_url("redis+cluster://:pw@h:6379").password == "pw"
    for bad in ("redis://h:1", "redis+cluster://h", "redis+cluster://h:99999", "redis+cluster://h:1/3"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_launcher_starts_three_masters_covering_every_slot(redis_cluster):
    client = cluster_client(redis_cluster.url, 2.0)
    masters = client.get_primaries()
    assert len(masters) == 3 and len({m.port for m in masters}) == 3
    info = client.cluster_info(target_nodes=client.get_random_node())
    assert info["cluster_state"] == "ok" and int(info["cluster_slots_assigned"]) == 16384
    client.close()
