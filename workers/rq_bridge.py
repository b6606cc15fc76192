"""rq bookkeeping for a worker that runs many jobs at once in one process.

rq 3.0's ``BaseWorker`` tracks several executions per worker, so we reuse its bookkeeping
(registration, executions, heartbeats, success/failure registries) and never its ``work()``
loop, which would run one job at a time. rq is synchronous and its worker object is not
thread-safe: every call that touches the worker runs on one dedicated thread (``_books``); the
blocking dequeue has its own thread so it never delays a heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.client import Pipeline
from rq import Queue
from rq.exceptions import DequeueTimeout, InvalidJobOperation
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from store import defaults
from store.coalesce import Coalescer
from store.connection import connect_sync
from store.errors import InvalidRolloutId
from store.keys import Keys, check_rollout_id
from store.queue import JOB_FUNC, rollout_queue

T = TypeVar("T")

log = logging.getLogger("rollouts.rq")

# How long rq lists a superseded job among the canceled ones (as its finished jobs: an hour).
SUPERSEDED_TTL_S = 3600
# How long rq keeps a job's first-seen mark in its intermediate queue (IntermediateQueue).
FIRST_SEEN_TTL_S = 3600 * 24


class InProcessWorker(BaseWorker):
    """Registers and keeps rq's books; never executes a job function itself."""

    # rq's default death penalty uses signal.alarm, which only works on the main thread.
    death_penalty_class = TimerDeathPenalty
    # Seconds an execution stays "started" without a heartbeat; then it is abandoned and
    # ``requeue_abandoned`` gives its job back. The worker beats every RQ_HEARTBEAT_S.
    execution_ttl = int(defaults.RQ_EXECUTION_TTL_S)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # rq derives it from job.timeout; generations are long and our heartbeat is regular.
        return self.execution_ttl

    def execute_job(self, job: Job, queue: Queue) -> None:
        raise NotImplementedError("rollouts workers run jobs on their own event loop")


@dataclass(slots=True)
class TakenJob:
    """A job this worker took from rq. ``problem`` says why it is not a rollout job we can
    run (anyone with write access to Redis can enqueue anything); then ``rollout_id`` is ""."""

    job: Job
    queue: Queue
    execution: Execution
    rollout_id: str = ""
    problem: str | None = None
    # Set on the bookkeeping thread once rq has the job's outcome: a heartbeat queued behind
    # that bookkeeping must not touch the job again (its HSET would recreate a job that an
    # acknowledgement deleted in between, as a bare hash with no TTL).
    ended: bool = False
    # Set on the bookkeeping thread once rq lists the job as started by this worker: a
    # heartbeat before that (``dequeue_many(await_start=False)``) would beat an execution rq
    # does not have yet.
    started: bool = False


def job_problem(job: Job) -> tuple[str, str | None]:
    """``(rollout id, None)`` for a job of ours, ``("", why not)`` for anything else."""
    try:
        func, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as exc:
        # rq decodes the payload lazily; JSON that is not [func, instance, args, kwargs], or
        # not JSON at all, surfaces here (DeserializationError and its causes).
        return "", f"undecodable job payload ({type(exc).__name__})"
    if func != JOB_FUNC:
        return "", f"job function {func!r} is not {JOB_FUNC}"
    if args or not isinstance(kwargs, dict) or set(kwargs) != {"rollout_id"}:
        got = f"args={args!r:.80} kwargs={kwargs!r:.80}"
        return "", f"a rollout job takes exactly one argument, rollout_id; got {got}"
    try:
        return check_rollout_id(kwargs["rollout_id"]), None
    except InvalidRolloutId as exc:
        return "", str(exc)


def _read_whose(pipe: Pipeline, r: TakenJob) -> None:
    """Queue the two reads that say whose a job is: our execution's score in the started
    registry, and the job's status (``_ours_to_end`` reads them)."""
    pipe.zscore(r.queue.started_job_registry.key, r.execution.composite_key)
    pipe.hget(r.job.key, "status")


def _ours_to_end(score: Any, status: bytes | None, *, even_if_failed: bool) -> bool:
    """Whether this execution may record the job's end: still started by it, or failed by rq's
    maintenance during an outage when the end takes it out of failed (``even_if_failed``:
    a success or a requeue; see ``RqBridge._finish_now``)."""
    return (score is not None and status == b"started") or (even_if_failed and status == b"failed")


class RqBridge:
    def __init__(
        self,
        url: str,
        queue_names: list[str],
        name: str,
        *,
        execution_ttl_s: float = defaults.RQ_EXECUTION_TTL_S,
        keys: Keys | None = None,
    ) -> None:
        self.connection = connect_sync(url)
        self.keys = keys or Keys()
        self.queues = [rollout_queue(self.connection, n) for n in queue_names]
        self.worker = InProcessWorker(
            self.queues,
            name=name,
            connection=self.connection,
            serializer=JSONSerializer,
            worker_ttl=max(1, round(execution_ttl_s)) * 2,
        )
        self.worker.execution_ttl = max(1, round(execution_ttl_s))
        self._books_thread = ThreadPoolExecutor(1, thread_name_prefix="rq-books")
        self._dequeue_thread = ThreadPoolExecutor(1, thread_name_prefix="rq-dequeue")
        self.running: dict[str, TakenJob] = {}  # execution id -> job
        self._successes = Coalescer(self._succeed_many)

    async def _books(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        return await loop.run_in_executor(self._books_thread, call)

    async def register(self) -> None:
        def birth() -> None:
            self.worker.register_birth()
            self.worker.set_state(WorkerStatus.IDLE)

        await self._books(birth)

    async def dequeue_many(
        self, timeout: int, limit: int, *, await_start: bool = True
    ) -> list[TakenJob]:
        """Block (in a thread) up to ``timeout`` s for a job, or take up to ``limit`` that are
        already queued (this worker's share of them, beside the other workers on the queue),
        and mark them all started as ours in one round trip. Empty if none came.

        Why several at once: each call costs two hops between the event loop and a thread,
        and a thread waits for the GIL up to the interpreter's switch interval (5 ms) after
        each reply while the loop is busy with the engine's steps. One job per call took a
        worker ~20 ms per rollout, measured, so at 256 rollouts in flight it never had more
        than ~14 running (bench/bench_overhead.py's gpu_cadence).

        ``await_start=False`` returns before rq has the start: its transaction goes to the
        bookkeeping thread, ahead of anything else done there for these jobs (heartbeats,
        their ends), and the jobs' rollouts may start meanwhile. The worker takes jobs that
        way: the start is ~4 ms on that thread (more when it waits behind a batch of
        successes), during which a freed engine slot stood empty. Should it fail (Redis gone
        for longer than the retries), rq never lists the jobs as started; they stay in its
        intermediate list and are swept back (``_requeue_stuck_dequeues``), and a rollout that
        ended meanwhile ends its next job at once.
        """
        loop = asyncio.get_running_loop()
        take = functools.partial(self._take, timeout, limit)
        found = await loop.run_in_executor(self._dequeue_thread, take)
        if not found:
            return []
        taken, pipe = self._prepare_start(found)
        if await_start:
            await self._books(self._start, taken, pipe)
        for running in taken:
            running.rollout_id, running.problem = job_problem(running.job)
            self.running[running.execution.id] = running
        if not await_start:
            self._books_thread.submit(self._start_or_forget, taken, pipe)
        return taken

    def _take(self, timeout: int, limit: int) -> list[tuple[Job, Queue]]:
        """On the dequeue thread: up to ``limit`` jobs already queued (this worker's share of
        them); if there are none, the first to come (waiting up to ``timeout`` s) and up to
        ``limit`` - 1 more queued by then."""
        if len(self.queues) == 1:
            # Jobs waiting (a step's groups, or a slot freed while the queue is long): three
            # round trips for all of them, where a blocking pop first took five. Each is a
            # thread hop with its GIL wait, and the pop an fsync under AOF ``always``, while
            # the freed slot waits (bench_vllm: ~2 ms of the ~17 between a rollout's end and
            # the next one's start).
            queued = self._more(limit)
            if queued:
                return queued
        first = self._one(timeout)
        if first is None:
            return []
        if limit == 1:
            return [first]
        try:
            return [first, *self._more(limit - 1)]
        except Exception:
            # The first is ours to start; anything popped and not started is swept back by
            # ``requeue_abandoned``, as after a crash between pop and start.
            log.warning("taking more jobs failed; starting one", exc_info=True)
            return [first]

    def _one(self, wait: int | None) -> tuple[Job, Queue] | None:
        try:
            return Queue.dequeue_any(
                self.queues,
                wait,
                connection=self.connection,
                job_class=self.worker.job_class,
                serializer=JSONSerializer,
            )
        except DequeueTimeout:
            return None

    def _more(self, n: int) -> list[tuple[Job, Queue]]:
        """Up to ``n`` more jobs already queued: rq's non-blocking dequeue (LMOVE to the
        intermediate queue, then the job's hash), all of them in three round trips."""
        if len(self.queues) > 1:  # rq's order across queues: one at a time
            found: list[tuple[Job, Queue]] = []
            while len(found) < n and (job := self._one(None)) is not None:
                found.append(job)
            return found
        queue = self.queues[0]
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.llen(queue.key)
            pipe.scard(WORKERS_BY_QUEUE_KEY % queue.name)
            queued, workers = pipe.execute()
        # Only this worker's share of what is queued now: one with free slots taking it all
        # would run a short queue (a step's last groups) alone while the others idle.
        n = min(n, -(-int(queued) // max(1, int(workers))))
        if n <= 0:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for _ in range(n):
                pipe.lmove(queue.key, queue.intermediate_queue_key)
            ids = [i.decode() for i in pipe.execute() if i is not None]
        jobs = self.worker.job_class.fetch_many(
            ids, connection=self.connection, serializer=JSONSerializer
        )
        # A job whose hash is gone is skipped, as rq's dequeue does.
        return [(job, queue) for job in jobs if job is not None]

    def _prepare_start(self, found: list[tuple[Job, Queue]]) -> tuple[list[TakenJob], Pipeline]:
        """rq's prepare_execution and prepare_job_execution for every job, the same commands
        in one transaction instead of two round trips per job; queued, not sent. Touches only
        the jobs (the worker object's share is ``_start``'s, on the bookkeeping thread)."""
        w = self.worker
        taken = []
        pipe = self.connection.pipeline()
        for job, queue in found:
            ttl = w.get_heartbeat_ttl(job)
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=w.name)
            job.heartbeat(now(), ttl, pipeline=pipe)
            job.prepare_for_execution(w.name, pipeline=pipe)
            pipe.persist(job.key)
            if len(self.queues) == 1:
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            # A sweep that caught the job between the pop and this start marked it
            # (``_requeue_stuck_dequeues``); started, it is not stuck: the mark would
            # otherwise stay for rq's 24 h.
            pipe.delete(IntermediateQueue(queue.key, connection=self.connection)
                        .get_first_seen_key(job.id))  # fmt: skip
            taken.append(TakenJob(job, queue, execution))
        return taken, pipe

    def _start(self, taken: list[TakenJob], pipe: Pipeline) -> list[TakenJob]:
        """On the books thread: the worker's state and heartbeat, and the transaction sent."""
        w = self.worker
        with pipe:
            w.set_state(WorkerStatus.BUSY, pipeline=pipe)
            w.heartbeat(w.get_heartbeat_ttl(taken[-1].job), pipeline=pipe)
            pipe.execute()
        for t in taken:
            w.executions[t.execution.id] = t.execution
            t.started = True
        return taken

    def _start_or_forget(self, taken: list[TakenJob], pipe: Pipeline) -> None:
        """``_start`` for jobs already running (``dequeue_many(await_start=False)``); if it
        fails, they are not heartbeated nor ended as ours: rq never listed them."""
        try:
            self._start(taken, pipe)
        except Exception:
            log.warning(
                "rq could not record the start of %d jobs; they will be swept back to the "
                "queue and run again (their rollouts are fenced)", len(taken), exc_info=True,
            )  # fmt: skip
            for t in taken:
                t.ended = True
                self.running.pop(t.execution.id, None)

    async def heartbeat(self) -> None:
        def beat() -> None:
            ttl = self.worker.execution_ttl
            with self.connection.pipeline() as pipe:
                self.worker.heartbeat(ttl * 2, pipeline=pipe)
                for r in list(self.running.values()):
                    if r.ended or not r.started:
                        continue
                    r.execution.heartbeat(r.queue.started_job_registry, ttl, pipeline=pipe)
                    r.job.heartbeat(now(), ttl, pipeline=pipe)
                pipe.execute()

        await self._books(beat)

    async def succeed(self, r: TakenJob, result: dict[str, Any]) -> None:
        """Record the job's success as rq's ``handle_job_success`` does. The successes that
        arrive together are recorded together (``_record_successes``): one at a time, rq's
        bookkeeping took ~7 round trips per job on the books thread, the largest part of a
        worker's CPU per rollout at GPU cadence (bench_overhead's gpu_cadence profile)."""
        await self._successes((r, result))

    async def _succeed_many(
        self, items: list[tuple[TakenJob, dict[str, Any]]]
    ) -> list[BaseException | None]:
        outcomes = await self._books(self._record_successes, items)
        for (r, _), outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                # Only once rq has it: until then the heartbeat keeps the execution alive.
                self.running.pop(r.execution.id, None)
        return outcomes

    def _record_successes(
        self, items: list[tuple[TakenJob, dict[str, Any]]]
    ) -> list[BaseException | None]:
        """On the books thread: what ``_finish`` and rq's ``handle_job_success`` do for one
        job, for all of ``items`` in three round trips: read whose each job is, one MULTI with
        every job's success, then the acknowledged rollouts' jobs deleted. rq's WATCH on a
        job's dependents is what makes its own call one transaction per job; a job with
        dependents, repeats or a rate limit (none of ours has them: anyone may enqueue one)
        goes through rq's own call instead."""
        with self.connection.pipeline(transaction=False) as pipe:
            for r, _ in items:
                _read_whose(pipe, r)
                pipe.scard(r.job.dependents_key)
            replies = pipe.execute()
        outcomes: list[BaseException | None] = [None] * len(items)
        alone, recorded = [], []
        ended_at = now()
        with self.connection.pipeline() as pipe:
            for i, (r, result) in enumerate(items):
                score, status, dependents = replies[3 * i : 3 * i + 3]
                if _ours_to_end(score, status, even_if_failed=True):
                    if dependents or r.job.repeats_left or getattr(r.job, "has_rate_limit", 0):
                        alone.append(i)
                        continue
                    mark = len(pipe.command_stack)
                    try:
                        self._success(r, result, ended_at, pipe)
                        recorded.append(r)
                    except Exception as exc:
                        del pipe.command_stack[mark:]  # nothing half-written for this job
                        outcomes[i] = exc
                elif status is None:
                    # The job is gone: its rollout was acknowledged first (see _finish).
                    self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
            pipe.execute()
        for i in alone:
            r, result = items[i]
            try:
                self._finish_now(r, functools.partial(self._succeed_alone, r, result), True)
            except Exception as exc:
                outcomes[i] = exc
        self._idle_if_empty()
        self._delete_acknowledged(recorded)
        for (r, _), outcome in zip(items, outcomes, strict=True):
            r.ended = r.ended or outcome is None
        return outcomes

    def _success(self, r: TakenJob, result: dict[str, Any], ended_at: Any, pipe: Pipeline) -> None:
        """rq 3's ``handle_job_success`` for a job with no dependents, repeats or rate limit,
        its commands queued on ``pipe``; out of failed first, should rq's maintenance have
        failed it during an outage."""
        w, job = self.worker, r.job
        job.ended_at = ended_at
        job._result = result
        r.queue.failed_job_registry.remove(job, pipeline=pipe)
        w.increment_successful_job_count(pipeline=pipe)
        w.increment_total_working_time(job.ended_at - job.started_at, pipe)
        result_ttl = job.get_result_ttl(w.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(
                result_ttl, pipeline=pipe, worker_name=w.name, execution_id=r.execution.id,
                execution_started_at=r.execution.created_at, execution_ended_at=job.ended_at,
            )  # fmt: skip
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        job._status = JobStatus.FINISHED
        w.cleanup_execution(job, pipeline=pipe, execution=r.execution)

    def _succeed_alone(self, r: TakenJob, result: dict[str, Any]) -> None:
        r.job.ended_at = now()
        r.job._result = result
        r.queue.failed_job_registry.remove(r.job)
        self.worker.handle_job_success(r.job, r.queue, r.queue.started_job_registry, r.execution)
        self._idle_if_empty()
        self._delete_acknowledged([r])

    def _delete_acknowledged(self, recorded: list[TakenJob]) -> None:
        """The trainer may acknowledge a rollout (deleting its job) as soon as it ended,
        before its success was recorded; that success just wrote the job and its result
        anew. Checked after the write, so an ack before it is seen here and one after it
        deleted what was written: either way nothing of an acknowledged rollout stays."""
        mine = [r for r in recorded if r.rollout_id]
        if not mine:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for r in mine:
                pipe.exists(self.keys.snapshot(r.rollout_id))
            alive = pipe.execute()
        gone = [r for r, exists in zip(mine, alive, strict=True) if not exists]
        if gone:
            with self.connection.pipeline() as pipe:
                for r in gone:
                    self._delete_job(r, pipe)
                pipe.execute()

    def _delete_job(self, r: TakenJob, pipe: Pipeline) -> None:
        pipe.delete(r.job.key, Result.get_key(r.job.id))
        pipe.zrem(r.queue.finished_job_registry.key, r.job.id)

    async def fail(self, r: TakenJob, error: str) -> None:
        def done() -> None:
            r.job.ended_at = now()
            self.worker.handle_job_failure(r.job, r.queue, exc_string=error, execution=r.execution)
            self._idle_if_empty()

        await self._finish(r, done)

    async def requeue(self, r: TakenJob, *, at_front: bool, queue: str | None = None) -> None:
        """Put a started job back on a queue: its own, or ``queue`` (the rollout's recorded
        queue, when the job came from another). Shutdown, weight update, retry."""
        target = r.queue if queue is None or queue == r.queue.name else self._queue(queue)

        def back() -> None:
            with self.connection.pipeline() as pipe:
                self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
                r.job.started_at = r.job.ended_at = None
                r.job.worker_name = None
                # A job rq's maintenance failed meanwhile (its heartbeat lapsed during an
                # outage) is ours to requeue all the same: its rollout still needs a run.
                pipe.zrem(r.queue.failed_job_registry.key, r.job.id)
                # rq has no public "started -> queued"; this is what its own requeue does.
                target._enqueue_job(r.job, pipeline=pipe, at_front=at_front)
                pipe.execute()
            self._idle_if_empty()

        await self._finish(r, back, even_if_failed=True)

    async def supersede(self, r: TakenJob) -> None:
        """End a job whose rollout another attempt owns (a duplicate delivery, or a run that
        was fenced out): rq lists it as canceled, not as a success or a failure; the job that
        owns the rollout reports its outcome."""

        def done() -> None:
            with self.connection.pipeline() as pipe:
                self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
                r.job.set_status(JobStatus.CANCELED, pipeline=pipe)
                r.queue.canceled_job_registry.add(r.job, ttl=SUPERSEDED_TTL_S, pipeline=pipe)
                pipe.execute()
            self._idle_if_empty()

        await self._finish(r, done)

    def forget(self, r: TakenJob) -> None:
        """Stop heartbeating a job whose bookkeeping could not be done (Redis stayed away):
        rq then calls it abandoned, and ``requeue_abandoned`` on some worker gives it back."""
        self.running.pop(r.execution.id, None)

    async def requeue_abandoned(self) -> list[str]:
        """Give back the jobs of this worker's queues that a dead worker held: executions
        whose heartbeat lapsed, and jobs stuck between the queue and the started registry
        (a worker killed mid-dequeue). rq's own maintenance fails them as abandoned; nothing
        would run their rollouts again, which would wait forever (their leases, if any, were
        already dropped or reaped). Returns the requeued job ids. A job whose rollout has
        ended meanwhile runs, finds it ended, and reports success."""

        def sweep() -> list[str]:
            requeued = []
            for q in self.queues:
                requeued += self._requeue_stuck_dequeues(q)
                started = q.started_job_registry
                expired = started.get_expired_job_ids()
                if not expired:
                    continue
                started.cleanup()  # what `rq info` would do: lapsed executions -> failed
                failed = q.failed_job_registry
                for job_id in dict.fromkeys(expired):
                    job = q.fetch_job(job_id)
                    if job is None or job.get_status() != JobStatus.FAILED:
                        continue
                    with contextlib.suppress(InvalidJobOperation):
                        # Another worker's sweep requeued it first.
                        failed.requeue(job, at_front=True)
                        requeued.append(job_id)
            return requeued

        return await self._books(sweep)

    def _requeue_stuck_dequeues(self, q: Queue) -> list[str]:
        """Jobs a worker took off ``q`` (into rq's intermediate list) and never started: it
        died in between. rq's own cleanup fails them after a minute; these go back to the
        front of the queue once seen stuck for an execution TTL. A worker that is merely
        slow to start one (a sub-second step) at worst gets a duplicate delivery, which the
        fencing turns into a superseded job."""
        intermediate = IntermediateQueue(q.key, connection=self.connection)
        stuck = intermediate.get_job_ids()
        if not stuck:
            return []
        live = set(q.started_job_registry.get_job_ids(cleanup=False))
        stuck = [job_id for job_id in stuck if job_id not in live]
        if not stuck:
            return []
        # Pipelined, as every list is long while a worker takes a batch of jobs (it pops
        # them all, then starts them all): one round trip per job here cost that worker
        # more than its dequeue did.
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in stuck:
                pipe.exists(Job.key_for(job_id))
            there = pipe.execute()
        # A job whose hash is gone was deleted (its rollout acknowledged while the job still
        # waited): rq's dequeue skipped it but left it here. Nothing to run: drop it.
        gone = [job_id for job_id, e in zip(stuck, there, strict=True) if not e]
        present = [job_id for job_id, e in zip(stuck, there, strict=True) if e]
        stamp = now().timestamp()
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in gone:
                pipe.lrem(intermediate.key, 1, job_id)
            for job_id in present:
                # rq's set_first_seen (NX: the first sweep that saw it) and get_first_seen.
                key = intermediate.get_first_seen_key(job_id)
                pipe.set(key, stamp, nx=True, ex=FIRST_SEEN_TTL_S)
                pipe.get(key)
            seen = pipe.execute()[len(gone) :][1::2]
        requeued = []
        for job_id, first in zip(present, seen, strict=True):
            if first is None or stamp - float(first) < self.worker.execution_ttl:
                continue
            # LREM decides the race between sweeps: only the one that removed it pushes it.
            if self.connection.lrem(intermediate.key, 1, job_id):
                q.push_job_id(job_id, at_front=True)
                requeued.append(job_id)
        return requeued

    def _queue(self, name: str) -> Queue:
        return rollout_queue(self.connection, name)

    async def _finish(
        self, r: TakenJob, fn: Callable[[], None], *, even_if_failed: bool = False
    ) -> None:
        await self._books(self._finish_now, r, fn, even_if_failed)
        # Only once rq has it: until then the heartbeat keeps the execution alive, so a call
        # retried through an outage is not beaten by rq declaring the job abandoned.
        self.running.pop(r.execution.id, None)

    def _finish_now(self, r: TakenJob, fn: Callable[[], None], even_if_failed: bool) -> None:
        """On the books thread: ``fn`` if the job is still ours to end.

        rq's maintenance (even `rq info`) fails executions whose heartbeat lapsed (a Redis
        outage longer than a heartbeat TTL does it). Such a job must not land in two
        registries: a success moves it from failed to finished, a requeue takes it out of
        failed (``even_if_failed``); anything else leaves rq's verdict."""
        with self.connection.pipeline(transaction=False) as pipe:
            _read_whose(pipe, r)
            score, status = pipe.execute()
        if _ours_to_end(score, status, even_if_failed=even_if_failed):
            fn()
        elif status is None:
            # The job is gone: the trainer acknowledged its rollout (store/lua/ack.lua
            # deletes the job) before this bookkeeping ran. Only our execution's records
            # are left to remove; recording a result would recreate what ack deleted.
            with self.connection.pipeline() as pipe:
                self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
                pipe.execute()
            self._idle_if_empty()
        r.ended = True

    def _idle_if_empty(self) -> None:
        if not self.worker.executions:
            self.worker.set_state(WorkerStatus.IDLE)

    async def close(self) -> None:
        try:
            await self._books(self.worker.register_death)
        finally:
            # Not waiting: a thread stuck in a Redis call must not block the event loop on exit.
            self._books_thread.shutdown(wait=False, cancel_futures=True)
            self._dequeue_thread.shutdown(wait=False, cancel_futures=True)
            self.connection.close()
