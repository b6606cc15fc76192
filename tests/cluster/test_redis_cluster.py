"""The throwaway Redis Cluster the cluster tests and benchmarks start (``store.redis_cluster``):
three masters and three replicas on loopback, each node its own redis-server and directory,
every slot served, every replica synced; a SIGKILLed master's replica takes its slots over."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from store.redis_cluster import RedisCluster
from tests.cluster.conftest import LIGHT

pytestmark = pytest.mark.redis_server


def test_a_cluster_forms_serves_every_slot_and_survives_a_master_killed(tmp_path: Path) -> None:
    with RedisCluster(tmp_path, node_timeout_ms=1000, config=LIGHT) as cluster:
        assert len(cluster.master_ports()) == 3 and len(cluster.nodes) == 6
        assert cluster.url.startswith("redis+cluster://127.0.0.1:")
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        for i in range(100):  # keys of many slots, on every master
            client.set(f"k{i}", i)
        info = cluster.cli(cluster.nodes[0].port, "CLUSTER", "INFO")
        assert "cluster_slots_assigned:16384" in info and "cluster_slots_ok:16384" in info
        # Each node keeps its own data directory (AOF on).
        assert all((n.data_dir / "nodes.conf").exists() for n in cluster.nodes)
        victim = cluster.master_ports()[0]
        cluster.node(victim).stop(kill=True)
        t0 = time.monotonic()
        cluster.wait_promoted(victim, timeout=30)
        assert victim not in cluster.master_ports() and len(cluster.master_ports()) == 3
        print(f"failover in {time.monotonic() - t0:.2f} s")
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.master_ports()[0])
        assert [int(client.get(f"k{i}")) for i in range(100)] == list(range(100))  # type: ignore[arg-type]
        client.close()


def test_one_master_is_formed_by_hand_with_its_replica(tmp_path: Path) -> None:
    # redis-cli --cluster create refuses fewer than 3 masters; bench_cluster compares 1, 3, 6.
    with RedisCluster(tmp_path, masters=1, replicas=1, config=LIGHT) as cluster:
        (master,) = cluster.master_ports()
        assert "cluster_slots_ok:16384" in cluster.cli(master, "CLUSTER", "INFO")
        client = redis.RedisCluster(host="127.0.0.1", port=master)
        for i in range(20):
            client.set(f"k{i}", i)
        assert client.wait(1, 1000) == 1
        replica = next(n.port for n in cluster.nodes if n.port != master)
        assert cluster.cli(replica, "DBSIZE").strip() == "20"
        client.close()
