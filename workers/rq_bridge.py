"""rq bookkeeping for a worker that runs many jobs at once in one process.

rq 3.0's ``BaseWorker`` tracks several executions per worker, so we reuse its bookkeeping
(registration, executions, heartbeats, success/failure registries) and never its ``work()``
loop, which would run one job at a time; what that takes of rq's internals is in
``workers.rq_mirror``. rq is synchronous and its worker object is not thread-safe: every call
that touches the worker runs on one dedicated thread (``_books``); the blocking dequeue has
its own thread so it never delays a heartbeat.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.client import Pipeline
from redis.exceptions import RedisError
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from store import defaults
from store.coalesce import Coalescer
from store.connection import connect_sync, connect_sync_store
from store.errors import unwritable
from store.keys import Keys
from store.queue import rollout_queue
from workers.affinity import RolloutJob, block_for_one, bounce, record_served
from workers.rq_jobs import fetch_each
from workers.rq_mirror import InProcessWorker, RqBooks, job_problem, pop_share, prepare_start
from workers.rq_sweep import StuckJobs

T = TypeVar("T")

log = logging.getLogger("rollouts.rq")


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


class RqBridge:
    def __init__(
        self,
        url: str,
        queue_names: list[str],
        name: str,
        *,
        execution_ttl_s: float = defaults.RQ_EXECUTION_TTL_S,
        keys: Keys | None = None,
        store_url: str | None = None,
    ) -> None:
        """``url``: the queue's Redis; ``store_url``: the store's, when it is another
        (``store.queue_redis``): rollouts' snapshots are read there, never beside rq's keys."""
        self.connection = connect_sync(url)
        # The store's Redis, for what rq's books check of a rollout (is it acknowledged?).
        self.store_connection = connect_sync_store(store_url) if store_url else self.connection
        self.apart = store_url is not None
        self.keys = keys or Keys()
        self.queues = [rollout_queue(self.connection, n) for n in queue_names]
        self.worker = InProcessWorker(
            self.queues,
            name=name,
            connection=self.connection,
            serializer=JSONSerializer,
            worker_ttl=max(1, round(execution_ttl_s)) * 2,
            job_class=RolloutJob,  # rq's, with a session's fields (workers.affinity)
        )
        self.worker.execution_ttl = max(1, round(execution_ttl_s))
        self._books_thread = ThreadPoolExecutor(1, thread_name_prefix="rq-books")
        self._dequeue_thread = ThreadPoolExecutor(1, thread_name_prefix="rq-dequeue")
        self.running: dict[str, TakenJob] = {}  # execution id -> job
        self._successes = Coalescer(self._succeed_many)
        # The sweep of this worker's queues for jobs a dead worker held (on the books thread).
        self._stuck = StuckJobs(
            self.connection,
            self.queues,
            lambda: self.worker.execution_ttl,
            self.keys,
            self.store_connection,
        )
        self._closing = False  # set by ``close``: retries on the bookkeeping thread give up
        # rq's books for the jobs it started, kept as rq keeps them (on the books thread).
        self.rq_books = RqBooks(self.worker, self.connection, self.keys, self.store_connection)
        # Set once this worker started a session's call: only then can a session prefer it,
        # and only then does it claim hints and flag itself waiting (``workers.affinity``).
        self.preferable = False

    async def _books(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        return await loop.run_in_executor(self._books_thread, call)

    async def register(self) -> None:
        def birth() -> None:
            # rq's register_birth is untyped; it returns None.
            self.worker.register_birth()  # type: ignore[no-untyped-call]
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
        intermediate list and are swept back (``StuckJobs``), and a rollout that
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
                return self._bounce(queued)
        first, left = self._one_and_left(timeout)
        if first is None:
            return []
        if limit == 1 or (left == 0 and not self.preferable):
            # Nothing more queued when the pop returned (an episode's next turn, pushed alone
            # by its tool's result): no third round trip to find that out again.
            return self._bounce([first])
        try:
            return self._bounce([first, *self._more(limit - 1)])
        except Exception:
            # The first is ours to start; anything popped and not started is swept back by
            # ``requeue_abandoned``, as after a crash between pop and start.
            log.warning("taking more jobs failed; starting one", exc_info=True)
            return [first]

    def _bounce(self, found: list[tuple[Job, Queue]]) -> list[tuple[Job, Queue]]:
        """``found`` less the jobs given back to the worker they prefer, waiting on the queue
        (``workers.affinity.bounce``); single-queue workers only (the others keep all)."""
        if len(self.queues) > 1:
            return found
        return bounce(self.connection, self.keys, self.worker.name, found)

    def _one_and_left(self, wait: int) -> tuple[tuple[Job, Queue] | None, int | None]:
        """``_one(wait)``, and on a single queue the jobs left on it right after the pop
        (None: not known)."""
        if len(self.queues) > 1:
            return self._one(wait), None
        # rq's blocking dequeue, flagged waiting while it blocks (``workers.affinity``).
        queue = self.queues[0]
        job_id, left = block_for_one(self.connection, self.keys, self.worker.name, queue, wait,
                                     flagged=self.preferable)  # fmt: skip
        if job_id is None:
            return None, left
        (job,) = fetch_each(self.worker.job_class, self.connection, queue, [job_id])
        return (None if job is None else (job, queue)), left  # gone: skipped, as rq skips it

    def _one(self, wait: int | None) -> tuple[Job, Queue] | None:
        if wait is not None and len(self.queues) == 1:
            return self._one_and_left(wait)[0]
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
        """Up to ``n`` more jobs already queued: rq's non-blocking dequeue, all of them in three
        round trips on a single queue (``rq_mirror.pop_share``)."""
        if len(self.queues) > 1:  # rq's order across queues: one at a time
            found: list[tuple[Job, Queue]] = []
            while len(found) < n and (job := self._one(None)) is not None:
                found.append(job)
            return found
        claim = (self.keys, self.worker.name) if self.preferable else None
        return pop_share(self.connection, self.queues[0], n, self.worker.job_class, claim=claim)

    def _prepare_start(self, found: list[tuple[Job, Queue]]) -> tuple[list[TakenJob], Pipeline]:
        """``rq_mirror.prepare_start`` for the jobs found; queued, not sent."""
        started, pipe = prepare_start(
            self.worker, self.connection, found, one_queue=len(self.queues) == 1
        )
        if len(self.queues) == 1:  # the others never claim hints (``workers.affinity``)
            jobs = [job for job, _ in found]
            if self.apart:  # the session's record is on the store: its own step (a hint)
                with self.store_connection.pipeline(transaction=False) as served:
                    if record_served(served, self.keys, self.worker.name, jobs):
                        self.preferable = True
                        try:
                            served.execute()
                        except RedisError:  # a hint unrecorded: the next call goes anywhere
                            log.warning("could not record this worker as its sessions' own",
                                        exc_info=True)  # fmt: skip
            elif record_served(pipe, self.keys, self.worker.name, jobs):
                self.preferable = True
        return [TakenJob(job, queue, execution) for job, queue, execution in started], pipe

    def _start(self, taken: list[TakenJob], pipe: Pipeline) -> list[TakenJob]:
        """On the books thread: the worker's state and heartbeat, and the transaction sent."""
        self.rq_books.start([t.execution for t in taken], taken[-1].job, pipe)
        for t in taken:
            t.started = True
        return taken

    def _start_or_forget(self, taken: list[TakenJob], pipe: Pipeline) -> None:
        """``_start`` for jobs already running (``dequeue_many(await_start=False)``); if it
        fails, they are not heartbeated nor ended as ours: rq never listed them.

        A start Redis refuses for a condition of its own (out of memory, a failed disk write)
        is retried until it is taken: the transaction was refused whole, and the jobs' rollouts
        run on meanwhile (they wait out the same condition). This thread waits with it, which
        holds back only bookkeeping that Redis would refuse too, and keeps the start first."""
        prepared = list(pipe.command_stack)
        delay, cap = defaults.STORE_RETRY_S
        deadline = time.monotonic() + defaults.BOOKS_RETRY_S
        while True:
            try:
                self._start(taken, pipe)
                return
            except Exception as exc:
                if unwritable(exc) is None or self._closing or time.monotonic() > deadline:
                    error = exc
                    break
            pipe.command_stack = list(prepared)  # ``_start`` emptied it, and adds its own
            time.sleep(delay)
            delay = min(2 * delay, cap)
        log.warning(
            "rq could not record the start of %d jobs; they will be swept back to the "
            "queue and run again (their rollouts are fenced)", len(taken), exc_info=error,
        )  # fmt: skip
        for t in taken:
            t.ended = True
            self.running.pop(t.execution.id, None)

    async def heartbeat(self) -> None:
        def beat() -> None:
            running = list(self.running.values())
            self.rq_books.beat([r for r in running if not r.ended and r.started])

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
        """On the books thread: ``RqBooks.record_successes``; each job recorded has ended."""
        outcomes = self.rq_books.record_successes(items)
        for (r, _), outcome in zip(items, outcomes, strict=True):
            r.ended = r.ended or outcome is None
        return outcomes

    async def fail(self, r: TakenJob, error: str) -> None:
        fail = functools.partial(self.rq_books.fail, r, error)
        await self._finish(r, fail, delete_acknowledged=True)

    async def requeue(self, r: TakenJob, *, at_front: bool, queue: str | None = None) -> None:
        """Put a started job back on a queue: its own, or ``queue`` (the rollout's recorded
        queue, when the job came from another). Shutdown, weight update, retry."""
        target = r.queue if queue is None or queue == r.queue.name else self._queue(queue)
        back = functools.partial(self.rq_books.requeue, r, target, at_front)
        # A MULTI does not undo its other commands when one fails at run time: with a queue key
        # of another type, the execution's cleanup would be done and the push not, leaving the
        # job in no registry and on no queue, and the retry finding it no longer ours. So that
        # key is checked with the read that precedes it, and nothing is written if it is bad:
        # the job stays started by us, retried, or (given up) abandoned and swept back.
        await self._finish(r, back, even_if_failed=True, pushes_onto=target.key)

    async def supersede(self, r: TakenJob) -> None:
        """End a job whose rollout another attempt owns (a duplicate delivery, or a run that
        was fenced out): rq lists it as canceled, not as a success or a failure; the job that
        owns the rollout reports its outcome."""
        cancel = functools.partial(self.rq_books.cancel, r)
        await self._finish(r, cancel, delete_acknowledged=True)

    def forget(self, r: TakenJob) -> None:
        """Stop heartbeating a job whose bookkeeping could not be done (Redis stayed away):
        rq then calls it abandoned, and ``requeue_abandoned`` on some worker gives it back."""
        self.running.pop(r.execution.id, None)

    async def requeue_abandoned(self) -> list[str]:
        """Give back the jobs of this worker's queues that a dead worker held (lapsed
        executions, jobs stuck mid-dequeue, jobs rq's own cleanup failed as abandoned), each
        in one atomic step (``workers.rq_sweep``). Returns the requeued job ids."""
        return await self._books(self._stuck.sweep)

    def _queue(self, name: str) -> Queue:
        return rollout_queue(self.connection, name)

    async def _finish(
        self,
        r: TakenJob,
        fn: Callable[[], None],
        *,
        even_if_failed: bool = False,
        pushes_onto: str | None = None,
        delete_acknowledged: bool = False,
    ) -> None:
        """``fn`` on the books thread if the job is still ours (``RqBooks.end_if_ours``);
        ``delete_acknowledged``: the job is then deleted if its rollout is gone (a failure
        or a cancel: ack leaves a started job to its worker, which ends it after)."""
        finish = functools.partial(
            self._finish_now, r, fn, even_if_failed, pushes_onto, delete_acknowledged
        )
        await self._books(finish)
        # Only once rq has it: until then the heartbeat keeps the execution alive, so a call
        # retried through an outage is not beaten by rq declaring the job abandoned.
        self.running.pop(r.execution.id, None)

    def _finish_now(
        self,
        r: TakenJob,
        fn: Callable[[], None],
        even_if_failed: bool,
        pushes_onto: str | None = None,
        delete_acknowledged: bool = False,
    ) -> None:
        """On the books thread: ``RqBooks.end_if_ours``; the job has ended for this worker."""
        self.rq_books.end_if_ours(
            r, fn, even_if_failed, pushes_onto, delete_acknowledged=delete_acknowledged
        )
        r.ended = True

    async def close(self) -> None:
        self._closing = True
        try:
            await self._books(self.worker.register_death)
        finally:
            # Not waiting: a thread stuck in a Redis call must not block the event loop on exit.
            self._books_thread.shutdown(wait=False, cancel_futures=True)
            self._dequeue_thread.shutdown(wait=False, cancel_futures=True)
            self.connection.close()
            if self.apart:
                self.store_connection.close()
