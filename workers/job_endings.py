"""How the worker ends the jobs it took: each attempt's outcome told to rq, and the books
kept truthful through anything.

An attempt's ``RunResult`` decides the job's end (``settle``): a success, a failure with the
reason (the rollout out of engine-error attempts, or recorded failed by the runner), a job given
back (first in line after a shutdown or weight update, after a backoff when the run failed), or
superseded (another attempt owns the rollout). Jobs that are not rollout jobs, or whose rollout
cannot be read, are refused to rq's failed registry. Every piece of bookkeeping is retried
through a Redis outage (``books``): a job left "started" with nobody heartbeating it is later
declared abandoned and failed by rq, whatever became of its rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from statemachine import Aborted, AbortReason, CodecError, FailureClass, RolloutState, Status
from store import AppendRefused, EventStore, defaults
from store.errors import unwritable
from store.logs import log_event
from workers.failures import record_failure
from workers.outcomes import Outcome, RunResult, Stats
from workers.rq_bridge import RqBridge, TakenJob
from workers.store_condition import StoreCondition

log = logging.getLogger("rollouts.worker")


class JobEndings:
    """The job endings of one worker's run, through its ``rq`` bridge. ``stopping``: set once
    the worker takes no more jobs (backoffs end early, retries give up sooner);
    ``engine_died``: the worker's, called when an attempt found the engine gone for good."""

    def __init__(
        self,
        rq: RqBridge,
        store: EventStore,
        stats: Stats,
        condition: StoreCondition,
        *,
        worker_id: str,
        max_engine_attempts: int,
        stopping: asyncio.Event,
        engine_died: Callable[[str], None],
    ) -> None:
        self.rq = rq
        self.store = store
        self.stats = stats
        self.condition = condition
        self.worker_id = worker_id
        self.max_engine_attempts = max_engine_attempts
        self.stopping = stopping
        self.engine_died = engine_died
        # Failures per rollout on this worker that gave its job back (they set the backoff).
        self._failures: dict[str, int] = {}

    def ran(self, rollout_id: str) -> None:
        """The rollout ran (or ended) here: its backoff starts over."""
        self._failures.pop(rollout_id, None)

    async def settle(
        self,
        running: TakenJob,
        result: RunResult,
        free_slot: Callable[[], None],
    ) -> None:
        """Tell rq how the attempt ended, and log what an operator should know."""
        rid, outcome, state = running.rollout_id, result.outcome, result.state
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        if outcome is Outcome.ENGINE_ERROR:
            errors = await self._engine_errors(rid)
            budget = self.max_engine_attempts
            if errors >= budget:
                await self._fail(state, result.error or "engine error", errors)
                why = f"rollout {rid} failed: {result.error}"
                await self.books(lambda: self.rq.fail(running, why), running)
                return
            log_event(
                log, logging.WARNING, "engine_error",
                f"rollout {rid} attempt {state.attempt}: engine error {errors} of {budget} on "
                f"{self.worker_id}, retrying: {result.error}",
                rollout_id=rid, attempt=state.attempt, worker=self.worker_id,
                errors=errors, budget=budget, error=result.error,
            )  # fmt: skip
            await self.give_back(running, state.queue, at_front=False)
        elif outcome is Outcome.FAILED:
            # Recorded failed by the runner (a request error, or its worker-lost budget): a
            # failed rq job with the reason, like a rollout out of engine-error attempts.
            why = f"rollout {rid} failed: {result.error}"
            await self.books(lambda: self.rq.fail(running, why), running)
        elif outcome is Outcome.ENGINE_DEAD:
            self.engine_died(result.error or "engine died")
            # First in line for a worker with an engine.
            await self.give_back(running, state.queue, at_front=True)
        elif outcome is Outcome.ABORTED:
            # Shutdown, weight update or the deployment paused (mode abort): first in line for
            # the next worker on current weights (after /resume, for a pause).
            await self.give_back(running, state.queue, at_front=True)
        elif outcome is Outcome.WRONG_QUEUE:
            log_event(
                log, logging.WARNING, "wrong_queue", f"rollout {rid}: {result.error}; moving "
                "the job there", rollout_id=rid, worker=self.worker_id, queue=state.queue,
            )  # fmt: skip
            await self.give_back(running, state.queue, at_front=True)
        elif outcome is Outcome.WRONG_MODEL:
            # Not ours to run: give it back, after a backoff, so a worker serving its model
            # takes it (on a queue that mixes models, which the queue was not meant to).
            await self.back_off(running, free_slot, result.error or "wrong model")
        elif outcome is Outcome.LOST and state.terminal:
            # Ended from outside while generating here (a trainer's cancel fences the attempt):
            # the engine request is aborted, its saved tokens stay; not a failure of the job.
            log_event(
                log, logging.INFO, "ended_elsewhere",
                f"rollout {rid} ended {state.status.value} while generating on "
                f"{self.worker_id} ({state.error or 'no reason given'}); job "
                f"{running.job.id} superseded",
                rollout_id=rid, attempt=state.attempt, worker=self.worker_id,
                status=state.status.value, job=running.job.id,
            )  # fmt: skip
            await self.books(lambda: self.rq.supersede(running), running)
        elif outcome in (Outcome.LOST, Outcome.DUPLICATE):
            log_event(
                log, logging.INFO, "superseded",
                f"rollout {rid}: job {running.job.id} superseded ({outcome.value}): attempt "
                f"{state.attempt} of worker {state.worker_id} owns it",
                rollout_id=rid, attempt=state.attempt, worker=self.worker_id,
                owner=state.worker_id, job=running.job.id, outcome=outcome.value,
            )  # fmt: skip
            await self.books(lambda: self.rq.supersede(running), running)
        else:
            summary = {"rollout_id": rid, "status": state.status.value, "outcome": outcome.value}
            await self.books(lambda: self.rq.succeed(running, summary), running)

    async def refuse(self, running: TakenJob, reason: str, *, recorded: bool = False) -> None:
        self.stats.outcomes["refused"] = self.stats.outcomes.get("refused", 0) + 1
        log_event(
            log, logging.ERROR, "refused",
            f"job {running.job.id} (rollout {running.rollout_id or '?'}) refused"
            f"{', rollout recorded as failed' if recorded else ''}: {reason}",
            rollout_id=running.rollout_id, worker=self.worker_id, job=running.job.id,
            error=reason,
        )  # fmt: skip
        await self.books(lambda: self.rq.fail(running, reason), running)

    async def fail_unreadable(self, rid: str, exc: CodecError) -> bool:
        try:
            recorded = await self.store.fail_unreadable(rid, f"unreadable record: {exc}")
        except Exception:
            # Its snapshot is damaged too (or Redis went away): the failed job says why.
            log.warning("rollout %s: cannot record the failure", rid, exc_info=True)
            return False
        if recorded:
            self.stats.end(Status.FAILED, FailureClass.UNREADABLE)
        return recorded

    async def back_off(
        self, running: TakenJob, free_slot: Callable[[], None] | None, why: str
    ) -> None:
        """Hold the job for a backoff that doubles with each failure of its rollout on this
        worker (capped), then give it back. The slot is freed meanwhile: other rollouts run."""
        if free_slot is not None:
            free_slot()
        rid = running.rollout_id
        n = self._failures[rid] = self._failures.get(rid, 0) + 1
        delay = min(defaults.REQUEUE_BACKOFF_MAX_S, defaults.REQUEUE_BACKOFF_S * 2 ** (n - 1))
        log_event(
            log, logging.WARNING, "backoff",
            f"rollout {rid}: {why}; job back on the queue in {delay:.1f} s (failure {n} here)",
            rollout_id=rid, worker=self.worker_id, error=why, seconds=delay, failures=n,
        )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), delay)
        queue = None
        with contextlib.suppress(Exception):
            # The rollout's own queue, when it can be read; else the job's.
            queue = (await self.store.load(rid)).queue
        await self.give_back(running, queue, at_front=False)

    async def give_back(self, running: TakenJob, queue: str | None, *, at_front: bool) -> None:
        back = await self.books(
            lambda: self.rq.requeue(running, at_front=at_front, queue=queue), running
        )
        if back:
            log.debug("rollout %s: job back on %s", running.rollout_id, queue)

    async def books(self, call: Callable[[], Awaitable[None]], job: TakenJob | None = None) -> bool:
        """One piece of rq bookkeeping, retried with backoff through a Redis outage longer
        than the client's own retries: a job left "started" with nobody heartbeating it is
        later declared abandoned and failed by rq, whatever became of its rollout. Gives up
        (logged, False) after ``BOOKS_RETRY_S``, or ``LOOP_STOP_S`` once stopping. Every call
        is safe to repeat: the bridge acts only on a job still started by this execution."""
        deadline = time.monotonic() + defaults.BOOKS_RETRY_S
        delay = defaults.REQUEUE_BACKOFF_S
        while True:
            sent = time.monotonic()
            try:
                await call()
                return True
            except Exception as exc:
                refused = unwritable(exc)
                if refused is not None and not self.stopping.is_set():
                    # Redis refuses writes: counted in its episode (logged once), and retried
                    # for as long as it lasts, however long: the job stays rq's truth.
                    self.condition.refused(refused, "rq bookkeeping", sent)
                    deadline = time.monotonic() + defaults.BOOKS_RETRY_S
                    await asyncio.sleep(self.condition.retry_s[1])
                    continue
                # Redis unreachable (rq's own bookkeeping raises nothing else here).
                left = deadline - time.monotonic()
                if self.stopping.is_set():
                    left = min(left, defaults.LOOP_STOP_S)
                if left <= 0:
                    log.error("rq bookkeeping failed; the job stays as rq last saw it",
                              exc_info=True)  # fmt: skip
                    if job is not None:
                        # No more heartbeats: rq calls it abandoned, a sweep gives it back.
                        self.rq.forget(job)
                    return False
                log.warning("rq bookkeeping failed; retrying in %.1f s", delay)
                await asyncio.sleep(min(delay, left))
                delay = min(2 * delay, defaults.REQUEUE_BACKOFF_MAX_S)

    async def _engine_errors(self, rollout_id: str) -> int:
        """Attempts of the rollout that the engine failed on.

        Not ``state.attempt``: weight updates, shutdowns, lost workers and dead engines end
        attempts too, and none of them is the rollout's fault; an RL run that updates weights
        every step would otherwise fail a rollout on its first real error. Read from the log
        only on this (rare) path, so the snapshot needs no extra counter.
        """
        events = await self.store.events(rollout_id)
        return sum(
            1 for e in events if isinstance(e, Aborted) and e.reason is AbortReason.ENGINE_ERROR
        )

    async def _fail(self, state: RolloutState, error: str, errors: int) -> None:
        try:
            # Its line (event "failure") is logged there.
            await self.condition.until_written(lambda: record_failure(
                self.store, state, error, FailureClass.ENGINE_ERROR, worker_id=self.worker_id,
                why=f"after {errors} engine errors on {self.worker_id}",
            ), "failure")  # fmt: skip
        except AppendRefused:
            # It moved on meanwhile (cancelled, or taken over): nothing of ours to record.
            return
        self.stats.end(Status.FAILED, FailureClass.ENGINE_ERROR)
