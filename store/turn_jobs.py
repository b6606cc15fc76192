"""The next turn's generation job of an episode, pushed in the transaction that records what
makes the turn due: a tool's result (``store.environment``) or a harness's next call
(``store.harness_turns``). ``lua/turn_job.lua`` writes rq's job and pushes it only if that
append landed, so a turn is never due without its job, nor given two.

With the queue on a Redis of its own (``store.queue_redis``) the transaction records the job's
id on the snapshot only, and ``push`` pushes the job once the append has landed: a turn left
due without its job (the process died in between) is the stranded sweep's to requeue."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from redis import Redis as SyncRedis
from redis.asyncio import Redis as AsyncRedis
from rq import Queue
from rq.job import Job

from statemachine import RolloutState, Status, codec
from store import scripts
from store.keys import Keys
from store.queue import JobWriter, push_jobs, rollout_queue

log = logging.getLogger("rollouts.turns")


class TurnJobs:
    """``connection``: a synchronous client of the queue's Redis, for rq's job templates
    (``store.queue.JobWriter``, built once per queue, in a thread: it asks the server's
    version)."""

    def __init__(self, connection: SyncRedis, keys: Keys, *, apart: bool = False) -> None:
        self.connection = connection
        self.keys = keys
        self.apart = apart
        self._writers: dict[str, JobWriter] = {}  # generation queue name -> its jobs' fields
        # Apart: the job each ``step`` named, by rollout, for ``push`` after the append.
        self._named: dict[str, tuple[JobWriter, str, dict[str, Any]]] = {}

    async def step(
        self, after: RolloutState, fields: dict[str, Any] | None = None
    ) -> list[scripts.Step]:
        """The step that pushes the next turn's job when ``after`` (the state the append
        leaves) is ``next_turn``; none otherwise (a budget ended the episode there).
        ``fields``: more of the job's hash (a session's affinity: ``store.affinity``)."""
        if after.status is not Status.NEXT_TURN:
            return []
        jobs = self._writers.get(after.queue)
        if jobs is None:
            queue = rollout_queue(self.connection, after.queue)
            jobs = self._writers[after.queue] = await asyncio.to_thread(JobWriter, queue)
        job_id = str(uuid.uuid4())
        if self.apart:
            self._named[after.rollout_id] = (jobs, job_id, fields or {})
            recorded: list[scripts.Arg] = [after.seq, codec.encode_snapshot(after), job_id]
            return [
                scripts.Call(scripts.TURN_JOB, [self.keys.snapshot(after.rollout_id)], recorded)
            ]
        shared = [x for kv in {**jobs.shared(), **(fields or {})}.items() for x in kv]
        keys = [self.keys.snapshot(after.rollout_id), jobs.queue.key,
                Queue.redis_queues_keys, Job.key_for(job_id)]  # fmt: skip
        args = [after.seq, codec.encode_snapshot(after), job_id, jobs.data(after.rollout_id),
                jobs.description(after.rollout_id), *shared]  # fmt: skip
        return [scripts.Call(scripts.TURN_JOB, keys, args)]

    async def push(self, redis: AsyncRedis, rollout_id: str) -> bool:
        """Apart: push the job ``step`` named for ``rollout_id``, once its append landed and
        if the snapshot lists it (the transaction recorded it: not a repeat); True if pushed.
        Nothing to do on one Redis, where the transaction pushed it."""
        named = self._named.pop(rollout_id, None)
        if named is None:
            return False
        jobs, job_id, fields = named
        listed = await redis.hget(self.keys.snapshot(rollout_id), "job")  # type: ignore[misc]
        if listed is None or job_id not in listed.decode().split():
            return False
        try:
            pushed = await asyncio.to_thread(
                push_jobs, jobs, [(job_id, rollout_id)], at_front=True, fields=fields
            )
        except Exception:
            # The result is recorded; only its job is missing: the stranded sweep's to give.
            log.warning("rollout %s: pushing its next turn's job failed; the stranded sweep "
                        "will requeue it", rollout_id, exc_info=True)  # fmt: skip
            return False
        return pushed > 0

    def forget(self, rollout_id: str) -> None:
        """Apart: the append of ``step``'s job did not land; nothing to push."""
        self._named.pop(rollout_id, None)
