"""What the worker reproduces of rq's own internals, in rq's own key layout: mirrors rq 3.0.0.

rq's ``Worker.work()`` runs one job at a time; a rollouts worker runs many at once on its own
event loop (``workers.rq_bridge``), so it keeps rq's books itself, as rq 3.0.0 would have kept
them, and often for many jobs in one round trip where rq takes several per job. Each piece
names what it mirrors; an rq upgrade must be checked against these (``rq>=3.0,<4`` in
pyproject.toml; tests/workers/test_batched_books.py compares the batched books with rq's own):

- ``InProcessWorker``: ``rq.worker.BaseWorker`` registered and heartbeated, with
  ``get_heartbeat_ttl`` fixed and ``execute_job`` refused (rq never runs our jobs).
- ``job_problem``: reads ``rq.job.Job``'s lazily decoded payload (``func_name``, ``args``,
  ``kwargs``).
- ``read_whose``/``ours_to_end``: the execution's score in ``StartedJobRegistry`` (by
  ``Execution.composite_key``) and the job hash's ``status`` field.
- ``pop_share``: ``Queue.dequeue_any`` without blocking (``Queue.lmove`` to the
  ``IntermediateQueue``, then ``Job.fetch_many``), for this worker's share of the queue
  (and the jobs hinted to it, ``workers.affinity``; its ``block_for_one`` is ``Queue.lmove``).
- ``prepare_start`` and ``RqBooks.start``: ``rq.executions.prepare_execution`` and
  ``BaseWorker.prepare_job_execution``.
- ``RqBooks.beat``: ``BaseWorker.maintain_heartbeats`` (``BaseWorker.heartbeat``,
  ``Execution.heartbeat``, ``Job.heartbeat``).
- ``RqBooks.record_successes``: ``BaseWorker.handle_job_success`` (its ``_success`` for a job
  with no dependents, repeats or rate limit; rq's own call for any other).
- ``RqBooks.fail``: ``BaseWorker.handle_job_failure``.
- ``RqBooks.requeue``: ``StartedJobRegistry.requeue`` (``Queue._enqueue_job``), from started.
- ``RqBooks.cancel``: ``Job.cancel``'s status and ``CanceledJobRegistry``.
- ``workers.rq_jobs.delete_job``: a job's keys as ``Job.delete`` and ``Result.get_key`` lay
  them out (store/lua/ack.lua deletes the same).
- ``workers.rq_jobs.drop_if_acknowledged``: ``delete_job`` in a success's own transaction.
- ``workers.rq_jobs.stamp_executions``: ``StartedJobRegistry.add_execution``'s by Redis's clock.
- ``workers.rq_jobs.touch_jobs``: ``Job.heartbeat``'s and ``Job.prepare_for_execution``'s
  HSETs, on jobs that still exist only (``lua/touch_jobs.lua``).

``RqBooks`` runs on the bridge's bookkeeping thread only: rq's worker object is not
thread-safe.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import ResponseError
from rq import Queue
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty
from rq.utils import now, utcformat
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from store import defaults
from store.errors import InvalidRolloutId
from store.keys import Keys, check_rollout_id
from store.queue import JOB_FUNC
from workers.affinity import queue_claim
from workers.rq_jobs import (
    delete_job,
    drop_if_acknowledged,
    fetch_each,
    stamp_executions,
    touch_jobs,
)

# How long rq lists a superseded job among the canceled ones (as its finished jobs: an hour).
SUPERSEDED_TTL_S = 3600

log = logging.getLogger("rollouts.rq")


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


class Started(Protocol):
    """A job this worker started (``workers.rq_bridge.TakenJob``), as rq's books need it."""

    job: Job
    queue: Queue
    execution: Execution
    rollout_id: str  # "" for a job that is not a rollout job


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


def rollout_of(connection: Redis, job_id: str, data: bytes | None) -> str:
    """The rollout of a job whose payload (its hash's ``data``) is ``data``: "" if it is
    no rollout job (``job_problem``'s verdict)."""
    if not data:
        return ""
    job = Job(job_id, connection=connection, serializer=JSONSerializer)
    try:
        job.data = zlib.decompress(data)
    except zlib.error:
        job.data = data  # rq's fallback: stored uncompressed (as store.queue writes it)
    return job_problem(job)[0]


def read_whose(pipe: Pipeline, r: Started) -> None:
    """Queue the two reads that say whose a job is: our execution's score in the started
    registry, and the job's status (``ours_to_end`` reads them)."""
    pipe.zscore(r.queue.started_job_registry.key, r.execution.composite_key)
    pipe.hget(r.job.key, "status")


def ours_to_end(score: Any, status: bytes | None, *, even_if_failed: bool) -> bool:
    """Whether this execution may record the job's end: still started by it, or failed by rq's
    maintenance during an outage when the end takes it out of failed (``even_if_failed``:
    a success or a requeue; see ``RqBooks.end_if_ours``)."""
    return (score is not None and status == b"started") or (even_if_failed and status == b"failed")


def pop_share(
    connection: Redis, queue: Queue, n: int, job_class: type[Job], *,
    claim: tuple[Keys, str] | None = None,
) -> list[tuple[Job, Queue]]:  # fmt: skip
    """Up to ``n`` jobs already queued on ``queue``, at most this worker's share of them: rq's
    non-blocking dequeue (LMOVE to the intermediate queue, then the job's hash), all of them
    in three round trips. ``claim`` (keys, this worker's name): first the jobs hinted to it
    (``workers.affinity``), in the first round trip, beside the queue's length."""
    with connection.pipeline(transaction=False) as pipe:
        if claim is not None:
            queue_claim(pipe, *claim, queue, n)
        pipe.llen(queue.key)
        pipe.scard(WORKERS_BY_QUEUE_KEY % queue.name)
        *claimed, queued, workers = pipe.execute()
    ids = [i.decode() for i in (claimed[0] if claimed else [])]
    # Only this worker's share of what is queued now: one with free slots taking it all
    # would run a short queue (a step's last groups) alone while the others idle.
    n = min(n - len(ids), -(-int(queued) // max(1, int(workers))))
    if n > 0:
        with connection.pipeline(transaction=False) as pipe:
            for _ in range(n):
                pipe.lmove(queue.key, queue.intermediate_queue_key)
            ids += [i.decode() for i in pipe.execute() if i is not None]
    if not ids:
        return []
    jobs = fetch_each(job_class, connection, queue, ids)
    # A job whose hash is gone is skipped, as rq's dequeue does.
    return [(job, queue) for job in jobs if job is not None]


def prepare_start(
    worker: InProcessWorker, connection: Redis, found: list[tuple[Job, Queue]], *, one_queue: bool
) -> tuple[list[tuple[Job, Queue, Execution]], Pipeline]:
    """rq's prepare_execution and prepare_job_execution for every job, the same commands
    in one transaction instead of two round trips per job; queued, not sent. Touches only
    the jobs (the worker object's share is ``RqBooks.start``'s, on the bookkeeping thread).
    ``one_queue``: the worker takes from a single queue (``RqBridge._take``), whose taken
    jobs are also removed from rq's intermediate list here."""
    w = worker
    started = []
    pipe = connection.pipeline()
    at = now()
    for job, queue in found:
        ttl = w.get_heartbeat_ttl(job)
        execution = Execution.create(job, ttl, pipeline=pipe, worker_name=w.name)
        # What rq's Job.heartbeat and prepare_for_execution set, written below.
        job.worker_name, job.last_heartbeat, job.started_at = w.name, at, at
        job._status = JobStatus.STARTED
        pipe.persist(job.key)
        if one_queue:
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        # A sweep that caught the job between the pop and this start marked it
        # (``StuckJobs``); started, it is not stuck: the mark would
        # otherwise stay for rq's 24 h.
        pipe.delete(IntermediateQueue(queue.key, connection=connection)
                    .get_first_seen_key(job.id))  # fmt: skip
        started.append((job, queue, execution))
    # rq's HSETs, only on the jobs that still exist: one acknowledged since it was read
    # (its rollout ended and the trainer acknowledged it, deleting the job) stays deleted.
    # Its execution is still created (with its TTL): the run finds the rollout gone and
    # ends it (``RqBooks.end_if_ours``), or, if the worker dies first, the sweep removes it.
    stamp = utcformat(at)
    fields = ["last_heartbeat", stamp, "status", JobStatus.STARTED.value, "started_at", stamp,
              "worker_name", w.name]  # fmt: skip
    touch_jobs(pipe, [job.key for job, _, _ in started], fields)
    # Judged by Redis's clock, not this host's (the TTL is one: ``get_heartbeat_ttl``).
    stamp_executions(pipe, [(e, q.started_job_registry.key) for _, q, e in started],
                     w.execution_ttl)  # fmt: skip
    return started, pipe


class RqBooks:
    """rq's books for the jobs one ``InProcessWorker`` started, kept as rq 3.0.0 keeps them.
    On the bridge's bookkeeping thread only. ``keys``: where a rollout's snapshot is (a
    success checks that its rollout was not acknowledged meanwhile), on ``store`` (the
    store's Redis; None: the queue's, ``connection``)."""

    def __init__(
        self, worker: InProcessWorker, connection: Redis, keys: Keys, store: Redis | None = None
    ) -> None:
        self.worker = worker
        self.connection = connection
        self.keys = keys
        # With the queue apart (store.queue_redis) a success cannot check its rollout in its
        # own transaction: it checks right after (``delete_acknowledged``). A worker killed
        # in between leaves an acknowledged rollout's job finished, which rq deletes after
        # JOB_RESULT_TTL_S (an hour): nothing of the rollout is kept, only the job's record.
        self.store = store or connection
        self.apart = store is not None and store is not connection

    def start(self, executions: list[Execution], last: Job, pipe: Pipeline) -> None:
        """The worker's state and heartbeat (its ttl judged by ``last``, the last job taken),
        and ``prepare_start``'s transaction sent; the executions are the worker's from then."""
        w = self.worker
        with pipe:
            w.set_state(WorkerStatus.BUSY, pipeline=pipe)
            w.heartbeat(w.get_heartbeat_ttl(last), pipeline=pipe)
            pipe.execute()
        for execution in executions:
            w.executions[execution.id] = execution

    def beat(self, started: list[Started]) -> None:
        """The worker's heartbeat and that of each of ``started``, in one transaction."""
        ttl = self.worker.execution_ttl
        at = now()
        with self.connection.pipeline() as pipe:
            self.worker.heartbeat(ttl * 2, pipeline=pipe)
            for r in started:
                r.execution.heartbeat(r.queue.started_job_registry, ttl, pipeline=pipe)
                r.job.last_heartbeat = at
            # rq's Job.heartbeat (an HSET), only on jobs that still exist: never recreating
            # one whose rollout was acknowledged meanwhile.
            touch_jobs(pipe, [r.job.key for r in started], ["last_heartbeat", utcformat(at)])
            # Judged by Redis's clock, not this host's (``workers.rq_jobs.stamp_executions``).
            stamp_executions(pipe, [(r.execution, r.queue.started_job_registry.key)
                                    for r in started], ttl)  # fmt: skip
            pipe.execute()

    def record_successes(
        self, items: Sequence[tuple[Started, dict[str, Any]]]
    ) -> list[BaseException | None]:
        """What ``end_if_ours`` and rq's ``handle_job_success`` do for one job, for all of
        ``items`` in two round trips: read whose each job is, then one MULTI with every job's
        success (each deleted within it if its rollout was acknowledged meanwhile:
        ``drop_if_acknowledged``). rq's WATCH on a job's
        dependents is what makes its own call one transaction per job; a job with
        dependents, repeats or a rate limit (none of ours has them: anyone may enqueue one)
        goes through rq's own call instead. Each item's outcome: None once recorded."""
        with self.connection.pipeline(transaction=False) as pipe:
            for r, _ in items:
                read_whose(pipe, r)
                pipe.scard(r.job.dependents_key)
            replies = pipe.execute()
        outcomes: list[BaseException | None] = [None] * len(items)
        alone = []
        ended_at = now()
        with self.connection.pipeline() as pipe:
            for i, (r, result) in enumerate(items):
                score, status, dependents = replies[3 * i : 3 * i + 3]
                if ours_to_end(score, status, even_if_failed=True):
                    if dependents or r.job.repeats_left or getattr(r.job, "has_rate_limit", 0):
                        alone.append(i)
                        continue
                    mark = len(pipe.command_stack)
                    try:
                        self._success(r, result, ended_at, pipe)
                    except Exception as exc:
                        del pipe.command_stack[mark:]  # nothing half-written for this job
                        outcomes[i] = exc
                elif status is None:
                    # The job is gone: its rollout was acknowledged first (see end_if_ours).
                    self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
            pipe.execute()
        if self.apart:
            self.delete_acknowledged([r for i, (r, _) in enumerate(items)
                                      if outcomes[i] is None and i not in alone])  # fmt: skip
        for i in alone:
            r, result = items[i]
            try:
                self.end_if_ours(r, functools.partial(self._succeed_alone, r, result), True)
            except Exception as exc:
                outcomes[i] = exc
        self.idle_if_empty()
        return outcomes

    def _success(self, r: Started, result: dict[str, Any], ended_at: Any, pipe: Pipeline) -> None:
        """rq 3's ``handle_job_success`` for a job with no dependents, repeats or rate limit,
        its commands queued on ``pipe``; out of failed first, should rq's maintenance have
        failed it during an outage."""
        w, job = self.worker, r.job
        job.ended_at = ended_at
        job._result = result
        r.queue.failed_job_registry.remove(job, pipeline=pipe)
        w.increment_successful_job_count(pipeline=pipe)
        started_at = job.started_at
        assert started_at is not None  # set by prepare_start, on this very object
        w.increment_total_working_time(job.ended_at - started_at, pipe)
        result_ttl = job.get_result_ttl(w.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(
                result_ttl, pipeline=pipe, worker_name=w.name, execution_id=r.execution.id,
                execution_started_at=r.execution.created_at, execution_ended_at=job.ended_at,
            )  # fmt: skip
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        job._status = JobStatus.FINISHED
        w.cleanup_execution(job, pipeline=pipe, execution=r.execution)
        if r.rollout_id and not self.apart:
            # Acknowledged since ``whose`` was read (ack left the job started, ours): what
            # this transaction wrote goes again within it, not a round trip later, which a
            # worker killed meanwhile never sent (the job stayed finished for an hour).
            drop_if_acknowledged(pipe, self.keys.snapshot(r.rollout_id), job.id, r.queue)

    def _succeed_alone(self, r: Started, result: dict[str, Any]) -> None:
        r.job.ended_at = now()
        r.job._result = result
        r.queue.failed_job_registry.remove(r.job)
        self.worker.handle_job_success(r.job, r.queue, r.queue.started_job_registry, r.execution)
        self.idle_if_empty()
        self.delete_acknowledged([r])

    def delete_acknowledged(self, recorded: list[Started]) -> None:
        """The trainer may acknowledge a rollout (deleting its job) as soon as it ended,
        before its job's end was recorded; that end just wrote the job and its result
        anew (ack leaves a started job to its worker). Checked after the write, so an ack
        before it is seen here and one after it deleted what was written: either way
        nothing of an acknowledged rollout stays. (Batched successes: ``drop_if_acknowledged``.)"""
        mine = [r for r in recorded if r.rollout_id]
        if not mine:
            return
        with self.store.pipeline(transaction=False) as pipe:
            for r in mine:
                pipe.exists(self.keys.snapshot(r.rollout_id))
            alive = pipe.execute()
        gone = [r for r, exists in zip(mine, alive, strict=True) if not exists]
        if gone:
            with self.connection.pipeline() as pipe:
                for r in gone:
                    delete_job(pipe, r.job.id, r.queue)
                pipe.execute()

    def fail(self, r: Started, error: str) -> None:
        """rq's failure; a job whose rollout is gone (acknowledged while a dead worker's run
        of it was swept back, or never submitted) is then deleted, by ``end_if_ours``'s
        ``delete_acknowledged``: nothing of an acknowledged rollout stays in Redis (the
        soak found such jobs kept 7 days)."""
        r.job.ended_at = now()
        self.worker.handle_job_failure(r.job, r.queue, exc_string=error, execution=r.execution)
        self.idle_if_empty()

    def requeue(self, r: Started, target: Queue, at_front: bool) -> None:
        """A started job back on ``target``, as rq's requeue puts a failed one back."""
        with self.connection.pipeline() as pipe:
            self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
            r.job.started_at = r.job.ended_at = None
            r.job.worker_name = None
            # A job rq's maintenance failed meanwhile (its heartbeat lapsed during an
            # outage) is ours to requeue all the same: its rollout still needs a run.
            pipe.zrem(r.queue.failed_job_registry.key, r.job.id)
            # rq has no public "started -> queued"; this is what its own requeue does.
            target._enqueue_job(r.job, pipeline=pipe, at_front=at_front)
            # ... except list the queue among rq's queues, as its enqueue does: a queue
            # nobody enqueued to before (a job moved to its rollout's own) was invisible
            # to `rq info`, ``find_stuck`` and the stranded-rollout net, which then
            # requeued a rollout that had a job (a duplicate).
            pipe.sadd(Queue.redis_queues_keys, target.key)
            pipe.execute()
        self.idle_if_empty()

    def cancel(self, r: Started) -> None:
        """rq lists the job as canceled (for ``SUPERSEDED_TTL_S``)."""
        with self.connection.pipeline() as pipe:
            self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
            r.job.set_status(JobStatus.CANCELED, pipeline=pipe)
            r.queue.canceled_job_registry.add(r.job, ttl=SUPERSEDED_TTL_S, pipeline=pipe)
            pipe.execute()
        self.idle_if_empty()

    def end_if_ours(
        self,
        r: Started,
        fn: Callable[[], None],
        even_if_failed: bool,
        pushes_onto: str | None = None,
        *,
        delete_acknowledged: bool = False,
    ) -> None:
        """``fn`` if the job is still ours to end; ``pushes_onto``: the queue key ``fn``
        pushes onto, which must be a list (checked first, nothing written);
        ``delete_acknowledged``: then the job is deleted if its rollout is gone, whether
        ``fn`` ran now or in an earlier try (one that raised after writing the end: the
        job is no longer started, so this try finds it not ours, and must still delete it).

        rq's maintenance (even `rq info`) fails executions whose heartbeat lapsed (a Redis
        outage longer than a heartbeat TTL does it). Such a job must not land in two
        registries: a success moves it from failed to finished, a requeue takes it out of
        failed (``even_if_failed``); anything else leaves rq's verdict."""
        with self.connection.pipeline(transaction=False) as pipe:
            read_whose(pipe, r)
            if pushes_onto is not None:
                pipe.type(pushes_onto)
            score, status, *kind = pipe.execute()
        held = [k.decode() if isinstance(k, bytes) else k for k in kind]
        if held and held[0] not in ("list", "none"):
            raise ResponseError(f"WRONGTYPE rq queue {pushes_onto} holds a {held[0]}")
        if ours_to_end(score, status, even_if_failed=even_if_failed):
            fn()
        elif status is None:
            # The job is gone: the trainer acknowledged its rollout (store/lua/ack.lua
            # deletes the job) before this bookkeeping ran. Only our execution's records
            # are left to remove; recording a result would recreate what ack deleted.
            with self.connection.pipeline() as pipe:
                self.worker.cleanup_execution(r.job, pipeline=pipe, execution=r.execution)
                pipe.execute()
            self.idle_if_empty()
        if delete_acknowledged:
            self.delete_acknowledged([r])

    def idle_if_empty(self) -> None:
        if not self.worker.executions:
            self.worker.set_state(WorkerStatus.IDLE)
