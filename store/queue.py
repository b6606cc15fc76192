"""The durable work queue: rq, with jobs that carry a rollout id and nothing else.

rq gives durability (a job pushed is never forgotten) and visibility (``rq info``, the
registries); it never runs our jobs' function itself: a rollouts worker takes jobs off rq's
queues and runs them on its resident engine. Job payloads are JSON (rq's JSONSerializer), so
nothing on the wire or at rest is pickled.

rq is synchronous, and so is everything here: async callers run it in a thread.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from store import defaults, rq_serializer, scripts  # noqa: F401  (rq's serializer check, once)
from store.keys import Keys

# The function rq records for every job. Workers never call it; it exists so that a stray
# stock ``rq worker`` fails the job with a clear message instead of an import error.
JOB_FUNC = "workers.jobs.run_rollout"
# How long rq keeps a finished job (and lists it as finished); ``ack`` deletes it sooner.
JOB_RESULT_TTL_S = 3600
# How long rq keeps a failed job (an unloadable one: rollouts that fail end as successes).
JOB_FAILURE_TTL_S = 7 * 86400


def rollout_queue(connection: Redis, name: str = defaults.QUEUE_NAME) -> Queue:
    return Queue(
        name,
        connection=connection,
        serializer=JSONSerializer,
        default_timeout=defaults.JOB_TIMEOUT_S,
    )


def enqueue_rollouts(
    queue: Queue,
    rollout_ids: Sequence[str],
    *,
    at_front: bool = False,
    keys: Keys | None = None,
    store: Redis | None = None,
) -> None:
    """Push one job per rollout id, all in one round trip. With ``keys``, each job is listed
    with its rollout's other jobs in the same transaction (``lua/record_job.lua``), so that
    acknowledging the rollout deletes it too: what a worker, the reaper's net or an operator
    pushes for a rollout that exists. ``store``: the store's Redis when the queue is on
    another (``store.queue_redis``): the jobs' ids are recorded there first, then the jobs
    pushed (``push_jobs``)."""
    if store is not None:
        assert keys is not None, "the rollouts' keys say where their snapshots are"
        named = list(zip(new_job_ids(len(rollout_ids)), rollout_ids, strict=True))
        record = scripts.RECORD_JOB.invocation(by_text=True)
        with store.pipeline(transaction=False) as pipe:
            for job_id, rid in named:
                pipe.execute_command(*record, 1, keys.snapshot(rid), job_id)  # type: ignore[no-untyped-call]
            pipe.execute()
        push_jobs(JobWriter(queue), named, at_front=at_front)
        return
    with queue.connection.pipeline() as pipe:
        for rid in rollout_ids:
            job = queue.enqueue_call(
                JOB_FUNC,
                kwargs={"rollout_id": rid},
                description=f"rollout {rid}",
                result_ttl=JOB_RESULT_TTL_S,
                failure_ttl=JOB_FAILURE_TTL_S,
                at_front=at_front,
                pipeline=pipe,
            )
            if keys is not None:
                record = scripts.RECORD_JOB.invocation(by_text=True)
                pipe.execute_command(*record, 1, keys.snapshot(rid), job.id)  # type: ignore[no-untyped-call]
        pipe.execute()


def give_back(
    jobs: JobWriter,
    leases_key: str,
    snapshot_key: str,
    rollout_id: str,
    seen_expiry: int,
    *,
    at_front: bool,
) -> bool:
    """Push a new job for a leased rollout and remove its lease, in one atomic step, if the
    lease is still the one seen (expiry ``seen_expiry``, unix ms): True if given back, False if
    the lease was renewed or removed meanwhile (nothing written). Raises, having written
    nothing, if the job cannot be pushed (Redis out of memory, a queue key of another type):
    the lease stays, so whoever retries finds it, and exactly one job is ever pushed for it
    (``lua/give_back.lua``), listed with the rollout's other jobs on its snapshot
    (``snapshot_key``) for its acknowledgement to delete. Blocking (rq's connection), like
    ``enqueue_rollouts``."""
    queue = jobs.queue
    job_id = str(uuid.uuid4())
    shared = [x for kv in jobs.shared().items() for x in kv]
    reply = scripts.run_sync(
        queue.connection,
        scripts.GIVE_BACK,
        [leases_key, queue.key, Queue.redis_queues_keys, Job.key_for(job_id), snapshot_key],
        [rollout_id, seen_expiry, job_id, jobs.data(rollout_id), jobs.description(rollout_id),
         "1" if at_front else "0", *shared],
    )  # fmt: skip
    return bool(reply)


def new_job_ids(count: int) -> list[str]:
    """Job ids as rq makes them (random UUIDs), from one urandom call."""
    random = os.urandom(16 * count)
    return [str(uuid.UUID(bytes=random[16 * i : 16 * i + 16], version=4)) for i in range(count)]


def push_jobs(
    jobs: JobWriter,
    named: Sequence[tuple[str, str]],
    *,
    at_front: bool = False,
    hint: tuple[list[str], list[Any]] = ([], []),
    fields: dict[str, Any] | None = None,
) -> int:
    """Push a job for each (job id, rollout id) in ``named`` onto ``jobs``' queue, each job id
    already recorded on its rollout's snapshot (the store step, first): the queue-side step
    when the queue is on a Redis of its own (``store.queue_redis``). Repeatable: a job that
    exists is not pushed again (``lua/push_jobs.lua``). ``hint``: a session's call's hint
    list, as ``Affinity.hint`` gives it; ``fields``: more fields of every job's hash (a
    session's, ``Affinity.job_fields``). How many were pushed now. Blocking (rq's
    connection)."""
    if not named:
        return 0
    queue = jobs.queue
    shared = {**jobs.shared(), **(fields or {})}
    keys = [queue.key, Queue.redis_queues_keys, *(Job.key_for(j) for j, _ in named), *hint[0]]
    args: list[Any] = [len(named), "1" if at_front else "0", len(shared)]
    for name, value in shared.items():
        args += [name, value]
    for job_id, rid in named:
        args += [job_id, jobs.data(rid), jobs.description(rid)]
    return int(scripts.run_sync(queue.connection, scripts.PUSH_JOBS, keys, args + hint[1]))


class JobWriter:
    """rq jobs for many rollouts, written as rq's own enqueue writes them, without its
    per-job Python work (a Job object, a Protocol check, two date formats and a JSON
    round trip each: half the time of a 10,000-rollout submit).

    The hash fields are those of one job rq built itself (``Queue.create_job`` then its
    ``_prepare_for_queue``), with the per-rollout fields replaced; ``tests/store`` checks
    that rq reads back every field of a written job as it reads a job it enqueued. Relies
    on rq's job layout (pinned >=3,<4, like the rest of store/ and workers/rq_mirror.py).
    """

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        template = queue.create_job(
            JOB_FUNC,
            kwargs={"rollout_id": "-"},
            description="-",
            result_ttl=JOB_RESULT_TTL_S,
            failure_ttl=JOB_FAILURE_TTL_S,
        )
        queue._prepare_for_queue(template)
        self._fields: dict[str, Any] = template.to_dict()
        raw = JSONSerializer.dumps((template.func_name, None, [], {"rollout_id": "-"}))  # type: ignore[no-untyped-call]
        assert raw.endswith(b'"-"}]'), raw  # the rollout id is the data's last value
        self._data_prefix = raw[: -len(b'"-"}]')]

    def shared(self) -> dict[str, Any]:
        """The fields every job of one enqueue has in common (stamped now)."""
        stamp = utcformat(now())
        # rq writes 8 of its fields empty (callbacks, started_at, worker_name, ...) and reads
        # each with ``obj.get(name)``'s truth (``Job.restore``): a field left out reads the same,
        # and a job hash of 9 fields instead of 17 took Redis' CPU for a 10,000-rollout submit
        # from 0.31 s to 0.20 s (measured).
        fields = {
            k: v for k, v in self._fields.items() if k not in ("data", "description") and v != ""
        }
        fields["created_at"] = fields["enqueued_at"] = stamp
        return fields

    def data(self, rollout_id: str) -> bytes:
        """The job's ``data`` field: rq's JSON of (function, instance, args, kwargs). Left
        uncompressed: rq reads an uncompressed one as it is (``Job.restore``'s fallback), and
        zlib's set-up costs more than these ~70 bytes would save."""
        data: bytes = self._data_prefix + json.dumps(rollout_id).encode() + b"}]"
        return data

    @staticmethod
    def description(rollout_id: str) -> str:
        return f"rollout {rollout_id}"


def fetch_each(
    connection: Redis,
    ids: list[str],
    job_class: type[Job] = Job,
    malformed: Callable[[str, NoSuchJobError], None] | None = None,
) -> list[Job | None]:
    """``Job.fetch_many`` (None for a job that is gone), except that a malformed job hash
    spoils only itself: rq raises for the whole batch on one hash without its payload (fields
    a dead worker's bare HSETs wrote back after the job was deleted; a 30-minute soak met one,
    and every dequeue and ``find_stuck`` then failed for the rest of the run). The batch is
    then fetched job by job, a malformed one is None and reported to ``malformed``."""
    try:
        return job_class.fetch_many(ids, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        pass
    jobs: list[Job | None] = []
    for job_id in ids:
        try:
            jobs.append(job_class.fetch(job_id, connection=connection, serializer=JSONSerializer))
        except NoSuchJobError as exc:
            if malformed is not None:
                malformed(job_id, exc)
            jobs.append(None)
    return jobs
