"""The next turn's generation job of an episode, pushed in the transaction that records what
makes the turn due: a tool's result (``store.environment``) or a harness's next call
(``store.harness_turns``). ``lua/turn_job.lua`` writes rq's job and pushes it only if that
append landed, so a turn is never due without its job, nor given two."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from redis import Redis as SyncRedis
from rq import Queue
from rq.job import Job

from statemachine import RolloutState, Status, codec
from store import scripts
from store.keys import Keys
from store.queue import JobWriter, rollout_queue


class TurnJobs:
    """``connection``: a synchronous client of the queue's Redis, for rq's job templates
    (``store.queue.JobWriter``, built once per queue, in a thread: it asks the server's
    version)."""

    def __init__(self, connection: SyncRedis, keys: Keys) -> None:
        self.connection = connection
        self.keys = keys
        self._writers: dict[str, JobWriter] = {}  # generation queue name -> its jobs' fields

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
        shared = [x for kv in {**jobs.shared(), **(fields or {})}.items() for x in kv]
        keys = [self.keys.snapshot(after.rollout_id), jobs.queue.key,
                Queue.redis_queues_keys, Job.key_for(job_id)]  # fmt: skip
        args = [after.seq, codec.encode_snapshot(after), job_id, jobs.data(after.rollout_id),
                jobs.description(after.rollout_id), *shared]  # fmt: skip
        return [scripts.Call(scripts.TURN_JOB, keys, args)]
