"""Acknowledging a rollout deletes every rq job made for it, not only the submit's (invariant
9: Redis holds in-flight and unacknowledged work only). The soak of issue 28 found job hashes
left after everything was acknowledged: the reaper's give back, the stranded-rollout net and
an operator's requeue each push a new job, which nothing recorded. Real redis-server."""

from __future__ import annotations

import redis.asyncio as aredis
from redis import Redis

from statemachine import RolloutRequest, SamplingParams
from store.client import RolloutClient
from store.leases import Leases
from store.queue import JobWriter, enqueue_rollouts, give_back, rollout_queue
from store.redis_server import RedisServer
from tests.store.trainer import finish


async def _job_keys(redis: aredis.Redis) -> list[bytes]:
    return sorted(await redis.keys("rq:job:*"))


async def test_ack_deletes_the_jobs_a_give_back_and_a_requeue_pushed(
    client: RolloutClient, real_redis: aredis.Redis, redis_server: RedisServer
) -> None:
    request = RolloutRequest(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=8))
    [rid] = await client.submit([request], batch_id="b")
    assert len(await _job_keys(real_redis)) == 1  # the submit's

    # The reaper gives the rollout back once (its lease lapsed), an operator requeues it once.
    leases = Leases(real_redis)
    await leases.take(rid, -1.0)
    [(_, expiry)] = await leases.expired()
    conn = Redis.from_url(redis_server.url)
    try:
        queue = rollout_queue(conn, "rollouts")
        snapshot = client.keys.snapshot(rid)
        assert give_back(JobWriter(queue), leases.key, snapshot, rid, expiry, at_front=True)
        enqueue_rollouts(queue, [rid], at_front=True, keys=client.keys)
    finally:
        conn.close()
    assert len(await _job_keys(real_redis)) == 3

    await finish(client.store, rid)
    report = await client.ack([rid])
    assert report.acked == [rid]
    assert await _job_keys(real_redis) == []


async def test_a_job_pushed_for_a_rollout_that_does_not_exist_is_not_recorded(
    client: RolloutClient, real_redis: aredis.Redis, redis_server: RedisServer
) -> None:
    """``record_job.lua`` writes no snapshot of its own: a rollout acknowledged (or never
    submitted) gets no half-made snapshot that would never be deleted."""
    conn = Redis.from_url(redis_server.url)
    try:
        enqueue_rollouts(rollout_queue(conn, "rollouts"), ["ghost"], keys=client.keys)
    finally:
        conn.close()
    assert not await real_redis.exists(client.keys.snapshot("ghost"))
