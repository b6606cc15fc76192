"""Worker processes generating on a Redis Cluster that loses a master, or moves slots, mid-run
(rq's queue on a redis-server of its own). With replica acknowledgement on, a failover loses
no acknowledged checkpoint: no worker's write is ever fenced out (no attempt aborted, one start
and one finish per rollout), and every greedy rollout equals the uninterrupted run. Each test
starts a cluster of its own, since it harms it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from redis import Redis

from statemachine import Aborted, RolloutRequest, Started
from store.connection import connect_cluster
from store.event_store import EventStore
from store.redis_cluster import RedisCluster
from store.redis_server import RedisServer
from tests.cluster.conftest import LIGHT
from tests.cluster.test_cluster_workers import _all_done, _check_exact, _saving, _submit
from tests.workers.helpers import SYNTHETIC, greedy, random_prompts, start_worker, stop, until

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]


def _requests(n: int, tokens: int) -> list[RolloutRequest]:
    return [RolloutRequest(prompt_token_ids=p, sampling=greedy(tokens))
            for p in random_prompts(n, seed=11, length=5)]  # fmt: skip


async def _run_through(
    cluster: RedisCluster, queue_url: str, tmp_path: Path, fault: object, *extra: str
) -> tuple[EventStore, list[str], list[RolloutRequest], float]:
    """Two paced workers run 24 rollouts; ``fault`` (a callable returning an awaitable) runs
    once each worker has saved tokens; everything ends. The store, ids, requests and how long
    the fault took."""
    store = EventStore(connect_cluster(cluster.url))
    reqs = _requests(24, 128)
    ids = await _submit(store, cluster.url, queue_url, reqs, "f")
    # The default lease TTL (5 s): a lease that lapses while its shard's master is down is
    # not taken over, the promoted replica's lease scripts granting a grace after the failover
    # (lua/lease_grace.lua); a takeover would restart its attempt, which the test rules out.
    args = ("--heartbeat", "0.25", "--queue-redis", queue_url, *extra)
    workers = [start_worker(cluster.url, SYNTHETIC, name, tmp_path / f"{name}.log", *args,
                            concurrency=4, synthetic={"token_delay_s": 0.02})
               for name in ("a", "b")]  # fmt: skip
    try:
        await until(lambda: _saving(store, ids, 8), what="the workers never saved")
        t0 = time.monotonic()
        await fault()  # type: ignore[operator]
        took = time.monotonic() - t0
        assert not await _all_done(store, ids)  # the fault came mid-run
        await until(lambda: _all_done(store, ids), timeout=240, what="the rollouts never ended")
    finally:
        stop(*workers)
    return store, ids, reqs, took


async def _check_nothing_fenced(store: EventStore, ids: list[str]) -> None:
    """No write a worker counted saved was lost: a lost one fences its next append out, and
    the attempt ends aborted (taken over) and starts again."""
    for rid in ids:
        events = await store.events(rid)
        aborts = [(e.reason, e.detail) for e in events if isinstance(e, Aborted)]
        assert aborts == [], (rid, aborts)
        assert sum(isinstance(e, Started) for e in events) == 1, rid


@pytest.fixture
def queue_url(redis_server: RedisServer) -> str:
    with Redis.from_url(redis_server.url) as r:
        r.flushall()
    return redis_server.url


async def test_workers_ride_out_a_master_killed_mid_run_with_replica_acks(
    tmp_path: Path, queue_url: str
) -> None:
    with RedisCluster(tmp_path / "cluster", node_timeout_ms=1000, config=LIGHT) as cluster:
        victim = cluster.master_ports()[0]

        async def failover() -> None:
            await asyncio.to_thread(cluster.node(victim).stop, kill=True)
            await asyncio.to_thread(cluster.wait_promoted, victim, 30)
            # The promoted replica has no replica of its own: checkpoints are not acknowledged
            # (the workers keep their tokens and retry) until the old master is back as one.
            await asyncio.to_thread(cluster.node(victim).start)

        store, ids, reqs, took = await _run_through(
            cluster, queue_url, tmp_path, failover, "--min-replicas-acked", "1"
        )
        await _check_nothing_fenced(store, ids)
        await _check_exact(store, ids, reqs)
        print(f"failover and the old master back in {took:.1f} s")
        await store.redis.aclose()


async def test_workers_ride_out_slots_resharded_mid_run(tmp_path: Path, queue_url: str) -> None:
    with RedisCluster(tmp_path / "cluster", replicas=0, config=LIGHT) as cluster:
        source, target = cluster.master_ports()[:2]
        ids = [cluster.cli(p, "CLUSTER", "MYID").strip() for p in (source, target)]

        async def reshard() -> None:
            moved = await asyncio.to_thread(
                cluster.cli, source, "--cluster", "reshard", f"127.0.0.1:{source}",
                "--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots", "2000",
                "--cluster-yes", timeout=120,
            )  # fmt: skip
            assert "Moving slot" in moved

        store, rids, reqs, took = await _run_through(cluster, queue_url, tmp_path, reshard)
        await _check_nothing_fenced(store, rids)
        await _check_exact(store, rids, reqs)
        print(f"2000 slots moved in {took:.1f} s")
        await store.redis.aclose()
