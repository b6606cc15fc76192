"""An ack with the queue on a Redis of its own (``--queue-redis``, ``store.queue_redis``):
ordered steps instead of ``lua/ack.lua``'s one, each repeatable, the rollout deleted last.

1. Each rollout's snapshot read (status, jobs) on the store: only ended ones go on.
2. Their jobs deleted on the queue (``lua/drop_job.lua``, by ``ack.lua``'s rule: a job still
   started is left to its worker), after one read of each job's queue (its registries' names).
3. The rollouts deleted on the store (``ack.lua`` with no rq prefix: no rq key touched).

A crash after step 2 leaves the rollout, which the next ack finds ended and deletes (its jobs
gone: step 2 has nothing left to do). The other order would leave jobs that nothing names any
more, for ``JOB_RESULT_TTL_S`` (an hour), or a week for a failed one.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis
from rq.executions import ExecutionRegistry
from rq.job import Job
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry
from rq.results import Result

from store import scripts
from store.keys import Keys

ENDED = (b"done", b"failed", b"cancelled")
_REGISTRIES = (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry)


async def ended_jobs(store: Redis, keys: Keys, ids: Sequence[str]) -> list[str]:
    """Step 1: the jobs of the rollouts of ``ids`` that have ended (one round trip)."""
    async with store.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hmget(keys.snapshot(rid), ["st", "job"])
        found = await pipe.execute()
    return [job.decode() for st, jobs in found if st in ENDED for job in (jobs or b"").split()]


async def drop_jobs(queue: Redis, job_ids: Sequence[str]) -> None:
    """Step 2: ``job_ids`` deleted on the queue's Redis, each with its results, executions and
    registry entries, but for a job still started (two round trips)."""
    if not job_ids:
        return
    async with queue.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "origin")
        origins = await pipe.execute()
    calls = []
    for job_id, origin in zip(job_ids, origins, strict=True):
        results: str = Result.get_key(job_id)  # type: ignore[no-untyped-call]
        job_keys = [Job.key_for(job_id), results, ExecutionRegistry.key_template.format(job_id)]
        if origin is not None:  # its queue's registries (declared: none is read from the job)
            job_keys += [r.key_template.format(origin.decode()) for r in _REGISTRIES]
        calls.append((job_keys, [job_id]))
    await scripts.DROP_JOB.many(queue, calls)
