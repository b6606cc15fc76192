"""Fixtures of the cluster tests: one Redis Cluster (3 masters, 3 replicas, each node its own
redis-server and directory on loopback) per test process, shared by the tests that do not
harm it; those that kill or reshape nodes start their own. Every cluster test is in one xdist
group ("redis-heavy"), so a CI run starts one shared cluster, not one per process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio.cluster import RedisCluster as ClusterClient

from store import EventStore
from store.connection import connect_cluster
from store.redis_cluster import RedisCluster

# Every node of a test's cluster fsyncs its AOF once a second, not per write: what these tests
# check rides on replication (WAIT, failover), not on one node's disk, and six nodes fsyncing
# every write starved the other tests' own redis-servers of the disk on a loaded CI run (a
# lease renewal in tests/store/test_bulk.py waited 4.2 s). bench_cluster measures both.
LIGHT = {"appendfsync": "everysec"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in item.nodeid:
            item.add_marker(pytest.mark.redis_server)
            # One group with tests/store/test_bulk.py, which measures Redis's CPU per call.
            item.add_marker(pytest.mark.xdist_group("redis-heavy"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    # No failover of its own under a loaded CI run: a node stalled for a second must not
    # look dead to the others (the tests that fail a master over start their own cluster).
    with RedisCluster(tmp_path_factory.mktemp("cluster"), node_timeout_ms=5000, config=LIGHT) as c:
        yield c


@pytest.fixture
async def cluster_client(cluster: RedisCluster) -> AsyncIterator[ClusterClient]:
    """A client of the shared cluster, every master emptied for the test."""
    client = connect_cluster(cluster.url)
    await client.initialize()
    await client.flushall(target_nodes=ClusterClient.PRIMARIES)
    yield client
    await client.aclose()


@pytest.fixture
def store(cluster_client: ClusterClient) -> EventStore:
    """The event store on the cluster (what tests/store/test_event_store_contract.py takes)."""
    return EventStore(cluster_client)
