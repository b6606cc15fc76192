"""rq job hashes written and deleted as rq 3.0.0 lays them out, never recreating a deleted job.

A rollout's acknowledgement deletes its rq jobs (store/lua/ack.lua) while workers may still
hold them: rq's own writes to a job's hash are bare HSETs, which would write a deleted job
back as a hash with no payload and no TTL, left in Redis for good. So the fields rq sets on a
started job go through ``touch_jobs`` (only on jobs that still exist), and a job is deleted
by ``delete_job`` (see ``workers.rq_mirror`` for the rest of rq's books).
"""

from __future__ import annotations

import logging

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job
from rq.results import Result

from store import queue as queue_jobs
from store import scripts

log = logging.getLogger("rollouts.rq")


def delete_job(pipe: Pipeline, job_id: str, queue: Queue) -> None:
    """Queue the deletion of a job's keys as ``Job.delete`` and ``Result.get_key`` lay them
    out (store/lua/ack.lua deletes the same), and its entries in the queue's registries of
    ended jobs. Its executions' index goes by its key, not rq's way: rq reads each
    execution listed there and raises on one whose hash expired (a dead worker's run lists
    one for a minute after): the deletion failed, and the job stayed."""
    # rq's Result is untyped; get_key only formats the result stream's key.
    result = Result.get_key(job_id)  # type: ignore[no-untyped-call]
    pipe.delete(Job.key_for(job_id), result, ExecutionRegistry(job_id, pipe).key)
    for registry in (queue.finished_job_registry, queue.failed_job_registry,
                     queue.canceled_job_registry):  # fmt: skip
        pipe.zrem(registry.key, job_id)


def touch_jobs(pipe: Pipeline, job_keys: list[str], fields: list[str]) -> None:
    """Queue ``lua/touch_jobs.lua``: ``fields`` (name, value, ...) set on those of the jobs
    that still exist. By its text, as it goes inside a MULTI (a NOSCRIPT would skip it)."""
    if job_keys:
        pipe.execute_command(  # type: ignore[no-untyped-call]
            *scripts.TOUCH_JOBS.invocation(), len(job_keys), *job_keys, *fields
        )


def drop_if_acknowledged(pipe: Pipeline, snapshot_key: str, job_id: str, queue: Queue) -> None:
    """Queue ``lua/drop_acknowledged_job.lua``, in the transaction that just wrote the job's
    end: the job deleted as ``delete_job`` deletes it if its rollout (``snapshot_key``) is
    gone. By its text, as it goes inside a MULTI (a NOSCRIPT would skip it)."""
    keys = [snapshot_key, Job.key_for(job_id), Result.get_key(job_id),  # type: ignore[no-untyped-call]
            ExecutionRegistry(job_id, pipe).key, queue.finished_job_registry.key,
            queue.failed_job_registry.key, queue.canceled_job_registry.key]  # fmt: skip
    pipe.execute_command(  # type: ignore[no-untyped-call]
        *scripts.DROP_ACKNOWLEDGED_JOB.invocation(), len(keys), *keys, job_id
    )


def stamp_executions(pipe: Pipeline, executions: list[tuple[Execution, str]], ttl: int) -> None:
    """Queue ``lua/stamp_executions.lua``: each execution's score in its started registry
    (execution, registry key) set by Redis's clock, after rq's host-clock stamp. By its
    text, as it goes inside a MULTI (a NOSCRIPT would skip it)."""
    if executions:
        pipe.execute_command(  # type: ignore[no-untyped-call]
            *scripts.STAMP_EXECUTIONS.invocation(), len(executions),
            *(key for _, key in executions), ttl, *(e.composite_key for e, _ in executions),
        )  # fmt: skip


def fetch_each(
    job_class: type[Job], connection: Redis, queue: Queue, ids: list[str]
) -> list[Job | None]:
    """``store.queue.fetch_each``, a malformed job hash deleted and its id taken off the
    intermediate list, with a warning: such a hash can be no one's job."""

    def drop(job_id: str, exc: NoSuchJobError) -> None:
        log.warning("job %s on %s: not a job (%s); deleted", job_id, queue.name, exc)
        with connection.pipeline() as pipe:
            pipe.delete(job_class.key_for(job_id))
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            pipe.execute()

    return queue_jobs.fetch_each(connection, ids, job_class, drop)
