"""``find_stuck`` (and so ``rollouts stuck`` and the stranded-rollout net) outlives a
malformed rq job hash: one bad record affects only itself (invariant 7). The 30-minute soak of
issue 28 met a job hash holding only ``last_heartbeat``, ``status`` and ``enqueued_at`` (fields
written back after the job was deleted); rq's ``Job.fetch_many`` raised NoSuchJobError for the
whole batch, every pass, and rollouts waiting with no job were never requeued. Real
redis-server."""

from __future__ import annotations

import redis.asyncio as aredis
from redis import Redis

from store.client import RolloutClient
from store.inspect import find_stuck
from store.queue import enqueue_rollouts, rollout_queue
from store.redis_server import RedisServer
from tests import factories as f


async def test_a_malformed_job_hash_spoils_only_itself(
    client: RolloutClient, real_redis: aredis.Redis, redis_server: RedisServer
) -> None:
    store = client.store
    # "queued": its job was pushed by rq's own enqueue, which no snapshot records (so the
    # jobs on the queues are decoded to find its rollout); "waiting" has no job at all.
    for rid in ("queued", "waiting"):
        await store.append(None, f.submitted(rid))
    conn = Redis.from_url(redis_server.url)
    try:
        queue = rollout_queue(conn, "rollouts")
        enqueue_rollouts(queue, ["queued"])
        conn.hset("rq:job:bad", mapping={"last_heartbeat": "x", "status": "queued",
                                          "enqueued_at": "y"})  # fmt: skip
        conn.lpush(queue.key, "bad")
        stuck = await find_stuck(store, conn, recheck_s=0.05)
    finally:
        conn.close()
    assert [(s.rollout_id, s.kind) for s in stuck] == [("waiting", "no_job")]
