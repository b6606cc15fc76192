"""Workers generating with the event store on a real Redis Cluster (3 masters, 3 replicas)
and rq's queue on a redis-server of its own: every rollout ends once with the tokens of an
uninterrupted run, spread over every master."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from redis import Redis
from redis.asyncio.cluster import RedisCluster as ClusterClient

from statemachine import Finished, RolloutRequest, Started, Status, Submitted
from store.connection import connect_sync_store
from store.event_store import EventStore
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_cluster import RedisCluster
from store.redis_server import RedisServer
from tests.workers.helpers import SYNTHETIC, direct_greedy, greedy, random_prompts, until
from workers.engines.synthetic import SyntheticEngine
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


@pytest.fixture
def queue_url(redis_server: RedisServer) -> str:
    """rq's queue on the session's redis-server, emptied for the test."""
    with Redis.from_url(redis_server.url) as r:
        r.flushall()
    return redis_server.url


async def _submit(store: EventStore, url: str, queue_url: str, reqs: list[RolloutRequest],
                  batch: str) -> list[str]:  # fmt: skip
    """The rollouts recorded on the cluster and enqueued, as an operator's requeue does."""
    ids = [f"{batch}.{i}.0" for i in range(len(reqs))]
    for rid, r in zip(ids, reqs, strict=True):
        await store.append(None, Submitted(rollout_id=rid, seq=1, request=r))
    sync = connect_sync_store(url)
    with Redis.from_url(queue_url) as q:
        await asyncio.to_thread(enqueue_rollouts, rollout_queue(q), ids, keys=store.keys,
                                store=sync)  # fmt: skip
    sync.close()
    return ids


@pytest.fixture
async def worker_task(
    cluster: RedisCluster, cluster_client: ClusterClient, queue_url: str
) -> AsyncIterator[Worker]:
    config = WorkerConfig(redis_url=cluster.url, queue_url=queue_url, name="w",
                          max_concurrency=4)  # fmt: skip
    worker = Worker(config, SyntheticEngine(tokens_per_chunk=4, token_delay_s=0.001))
    task = asyncio.create_task(worker.run())
    yield worker
    worker.request_stop()
    await asyncio.wait_for(task, 60)


async def test_a_worker_generates_across_the_cluster(
    store: EventStore, cluster: RedisCluster, queue_url: str, worker_task: Worker
) -> None:
    reqs = [RolloutRequest(prompt_token_ids=p, sampling=greedy(40))
            for p in random_prompts(12, seed=3, length=5)]  # fmt: skip
    ids = await _submit(store, cluster.url, queue_url, reqs, "cw")

    async def all_done() -> bool:
        states = [await store.head(rid) for rid in ids]
        return all(s.status is Status.DONE for s in states)

    await until(all_done, timeout=120, what="the rollouts never ended")
    want = await direct_greedy(None, SYNTHETIC, [r.prompt_token_ids for r in reqs],
                               reqs[0].sampling)  # fmt: skip
    for rid, (tokens, _) in zip(ids, want, strict=True):
        s = await store.load(rid)
        np.testing.assert_array_equal(s.token_ids, tokens)
        kinds = [type(e) for e in await store.events(rid)]
        assert kinds.count(Started) == 1 and kinds.count(Finished) == 1
