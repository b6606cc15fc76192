"""rq bookkeeping for a worker that runs many jobs at once in one process.

rq 3.0's ``BaseWorker`` tracks several executions per worker, so we reuse its bookkeeping
(registration, executions, heartbeats, success/failure registries) and never its ``work()``
loop, which would run one job at a time. rq is synchronous and its worker object is not
thread-safe: every call that touches the worker runs on one dedicated thread (``_bk``); the
blocking dequeue has its own thread so it never delays a heartbeat.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from store.connection import connect_sync
from store.queue import rollout_queue

T = TypeVar("T")


class InProcessWorker(BaseWorker):
    """Registers and keeps rq's books; never executes a job function itself."""

    # rq's default death penalty uses signal.alarm, which only works on the main thread.
    death_penalty_class = TimerDeathPenalty
    execution_ttl = 60  # seconds an execution stays "started" without a heartbeat

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # rq derives it from job.timeout; generations are long and our heartbeat is regular.
        return self.execution_ttl

    def execute_job(self, job: Job, queue: Queue) -> None:
        raise NotImplementedError("rollouts workers run jobs on their own event loop")


@dataclass(slots=True)
class Running:
    job: Job
    queue: Queue
    execution: Execution

    @property
    def rollout_id(self) -> str:
        return str(self.job.kwargs["rollout_id"])


class RqBridge:
    def __init__(self, url: str, queue_names: list[str], name: str) -> None:
        self.connection = connect_sync(url)
        self.queues = [rollout_queue(self.connection, n) for n in queue_names]
        self.worker = InProcessWorker(
            self.queues,
            name=name,
            connection=self.connection,
            serializer=JSONSerializer,
            worker_ttl=InProcessWorker.execution_ttl * 2,
        )
        self._bk = ThreadPoolExecutor(1, thread_name_prefix="rq-books")
        self._dq = ThreadPoolExecutor(1, thread_name_prefix="rq-dequeue")
        self.running: dict[str, Running] = {}  # execution id -> job

    async def _books(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._bk, functools.partial(fn, *args, **kwargs))

    async def register(self) -> None:
        def birth() -> None:
            self.worker.register_birth()
            self.worker.set_state(WorkerStatus.IDLE)

        await self._books(birth)

    async def dequeue(self, timeout: int) -> Running | None:
        """Block (in a thread) up to ``timeout`` s for a job; mark it started as ours."""
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(
                self._dq,
                functools.partial(
                    Queue.dequeue_any,
                    self.queues,
                    timeout,
                    connection=self.connection,
                    job_class=self.worker.job_class,
                    serializer=JSONSerializer,
                ),
            )
        except DequeueTimeout:
            return None
        if found is None:
            return None
        job, queue = found

        def start() -> Running:
            # rq's prepare_execution and prepare_job_execution, the same commands in one round
            # trip instead of two (this runs once per rollout).
            w = self.worker
            ttl = w.get_heartbeat_ttl(job)
            with self.connection.pipeline() as pipe:
                execution = Execution.create(job, ttl, pipeline=pipe, worker_name=w.name)
                w.set_state(WorkerStatus.BUSY, pipeline=pipe)
                w.heartbeat(ttl, pipeline=pipe)
                job.heartbeat(now(), ttl, pipeline=pipe)
                job.prepare_for_execution(w.name, pipeline=pipe)
                pipe.persist(job.key)
                if len(self.queues) == 1:
                    pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                pipe.execute()
            w.executions[execution.id] = execution
            return Running(job, queue, execution)

        running = await self._books(start)
        self.running[running.execution.id] = running
        return running

    async def heartbeat(self) -> None:
        def beat() -> None:
            ttl = InProcessWorker.execution_ttl
            with self.connection.pipeline() as pipe:
                self.worker.heartbeat(ttl * 2, pipeline=pipe)
                for r in list(self.running.values()):
                    r.execution.heartbeat(r.queue.started_job_registry, ttl, pipeline=pipe)
                    r.job.heartbeat(now(), ttl, pipeline=pipe)
                pipe.execute()

        await self._books(beat)

    async def succeed(self, r: Running, result: dict[str, Any]) -> None:
        def done() -> None:
            r.job.ended_at = now()
            r.job._result = result
            self.worker.handle_job_success(
                r.job, r.queue, r.queue.started_job_registry, r.execution
            )
            self._idle_if_empty()

        await self._finish(r, done)

    async def fail(self, r: Running, error: str) -> None:
        def done() -> None:
            r.job.ended_at = now()
            self.worker.handle_job_failure(r.job, r.queue, exc_string=error, execution=r.execution)
            self._idle_if_empty()

        await self._finish(r, done)

    async def requeue(self, r: Running, *, at_front: bool) -> None:
        """Put a started job back on its queue (shutdown, retry after an engine error)."""

        def back() -> None:
            with self.connection.pipeline() as pipe:
                self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
                r.job.started_at = r.job.ended_at = None
                r.job.worker_name = None
                # rq has no public "started -> queued"; this is what its own requeue does.
                r.queue._enqueue_job(r.job, pipeline=pipe, at_front=at_front)
                pipe.execute()
            self._idle_if_empty()

        await self._finish(r, back)

    async def _finish(self, r: Running, fn: Callable[[], None]) -> None:
        def guarded() -> None:
            # rq's maintenance (even `rq info`) fails executions whose heartbeat lapsed; one it
            # already failed must not also be finished, or it lands in two registries.
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.zscore(r.queue.started_job_registry.key, r.execution.composite_key)
                pipe.hget(r.job.key, "status")
                score, status = pipe.execute()
            if score is not None and status == b"started":
                fn()

        try:
            await self._books(guarded)
        finally:
            self.running.pop(r.execution.id, None)

    def _idle_if_empty(self) -> None:
        if not self.worker.executions:
            self.worker.set_state(WorkerStatus.IDLE)

    async def close(self) -> None:
        try:
            await self._books(self.worker.register_death)
        finally:
            self._bk.shutdown(wait=True)
            self._dq.shutdown(wait=False, cancel_futures=True)
            self.connection.close()
