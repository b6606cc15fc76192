"""The durable work queue: rq, with jobs that carry a rollout id and nothing else.

rq gives durability (a job pushed is never forgotten) and visibility (``rq info``, the
registries); it never runs our jobs' function itself: a rollouts worker takes jobs off rq's
queues and runs them on its resident engine. Job payloads are JSON (rq's JSONSerializer), so
nothing on the wire or at rest is pickled.

rq is synchronous; the async helpers here run it in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from store import defaults

# The function rq records for every job. Workers never call it; it exists so that a stray
# stock ``rq worker`` fails the job with a clear message instead of an import error.
JOB_FUNC = "workers.jobs.run_rollout"
# How long rq keeps a finished job (and lists it as finished); ``ack`` deletes it sooner.
JOB_RESULT_TTL_S = 3600


def rollout_queue(connection: Redis, name: str = defaults.QUEUE_NAME) -> Queue:
    return Queue(
        name,
        connection=connection,
        serializer=JSONSerializer,
        default_timeout=defaults.JOB_TIMEOUT_S,
    )


def enqueue_rollouts(queue: Queue, rollout_ids: Sequence[str], *, at_front: bool = False) -> None:
    """Push one job per rollout id, all in one round trip."""
    with queue.connection.pipeline() as pipe:
        for rid in rollout_ids:
            queue.enqueue_call(
                JOB_FUNC,
                kwargs={"rollout_id": rid},
                description=f"rollout {rid}",
                result_ttl=JOB_RESULT_TTL_S,
                failure_ttl=7 * 86400,
                at_front=at_front,
                pipeline=pipe,
            )
        pipe.execute()


async def enqueue_rollouts_async(
    queue: Queue, rollout_ids: Sequence[str], *, at_front: bool = False
) -> None:
    await asyncio.to_thread(enqueue_rollouts, queue, rollout_ids, at_front=at_front)
