"""The worker process: one resident engine, up to N rollouts generating on it at once.

rq is the durable queue (jobs carry rollout ids only); this process never forks per job. Its
event loop takes a job only when one of its N slots is free (or about to be: a rollout with
``prefetch_tokens`` left), runs the rollout on the engine, never more than N at once,
through a ``RolloutRunner``, and keeps rq's registries truthful through ``RqBridge``. Every
rollout's progress goes to Redis through one group-commit ``Checkpointer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from statemachine import (
    Aborted,
    AbortReason,
    CodecError,
    CorruptRecord,
    FailureClass,
    RolloutState,
    Status,
)
from store import AppendRefused, EventStore, RolloutNotFound, defaults
from store import stats as fleet
from store.connection import connect
from store.leases import Leases
from store.logs import log_event
from store.presence import Presence, PresenceWatch
from store.queue import rollout_queue
from store.weights import WeightRegistry
from workers.checkpoint import Checkpointer
from workers.engines.base import Engine
from workers.failures import record_failure
from workers.metrics import WorkerMetrics
from workers.reaper import Reaper
from workers.rq_bridge import RqBridge, TakenJob
from workers.runner import Cadence, Outcome, RolloutRunner, RunResult, Stats
from workers.weight_updates import WeightFollower, WeightMode

log = logging.getLogger("rollouts.worker")

# Jobs taken in one dequeue at most (as many as there are free slots and, beside other workers
# on the queue, this worker's share of what is queued: RqBridge.dequeue_many). One call costs
# two thread hops and their GIL waits however many it takes. Measured (gpu_cadence, 1,024 in
# flight): 85k tokens/s with 32, 166k with 128, as the worker reaches its slots sooner.
TAKE_AT_ONCE = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    redis_url: str
    queues: tuple[str, ...] = (defaults.QUEUE_NAME,)
    max_concurrency: int = 4
    name: str = field(
        default_factory=lambda: f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    )
    cadence: Cadence = field(default_factory=Cadence)
    max_engine_attempts: int = defaults.MAX_ENGINE_ATTEMPTS
    max_worker_lost: int = defaults.MAX_WORKER_LOST
    dequeue_timeout_s: int = defaults.DEQUEUE_TIMEOUT_S
    lease_ttl_s: float = defaults.LEASE_TTL_S
    heartbeat_s: float = defaults.HEARTBEAT_S  # lease renewal; rq's own heartbeat every 5th
    reap_interval_s: float = defaults.REAP_INTERVAL_S
    burst: bool = False  # exit once the queues are empty and nothing is running
    shutdown_grace_s: float = defaults.SHUTDOWN_GRACE_S
    weight_mode: WeightMode = WeightMode.ABORT
    # What attempts record as their model; None: the engine's own identity.
    model_id: str | None = None
    # rq calls a job abandoned (and some worker requeues it) after this long without our
    # heartbeat; heartbeats go out every RQ_HEARTBEAT_S (or every lease heartbeat, if slower).
    rq_execution_ttl_s: float = defaults.RQ_EXECUTION_TTL_S
    # Stream through the engine's whole steps (workers/stepper.py); None: if it offers them.
    # False: one stream per rollout (`rollouts worker --no-engine-steps`).
    stepped: bool | None = None
    # Take the next job when a rollout has this many tokens left (defaults.PREFETCH_TOKENS).
    prefetch_tokens: int = defaults.PREFETCH_TOKENS


class _Places:
    """The engine's N places for this worker's requests, and how long freed ones stood empty
    before the next rollout took them (``refill_s`` over ``refills``: bench_vllm reports it).
    Freed places are matched to takers first in, first out; ``forget`` drops those freed
    before a quiet spell (the end of a batch), which no rollout was waiting to refill."""

    def __init__(self, n: int) -> None:
        self._free = asyncio.Semaphore(n)
        self._freed_at: deque[float] = deque()
        self.refills = 0
        self.refill_s = 0.0

    async def acquire(self) -> None:
        await self._free.acquire()
        if self._freed_at:
            self.refills += 1
            self.refill_s += time.monotonic() - self._freed_at.popleft()

    def release(self) -> None:
        self._freed_at.append(time.monotonic())
        self._free.release()

    def forget(self) -> None:
        self._freed_at.clear()


class _Slot:
    """A taken job's two places, each released once, whoever releases first: one of the take
    loop's N slots (``slots``), given back when its rollout is nearly done (``nearly_free``)
    so that the next job is dequeued, loaded, leased and begun meanwhile; and, from ``enter``
    on, one of the engine's N places (``places``), given back when it no longer needs the
    engine. So up to N rollouts are on the engine and up to N more are being begun."""

    def __init__(self, slots: asyncio.Semaphore, places: _Places) -> None:
        self._slots: asyncio.Semaphore | None = slots
        self._places = places
        self._entered = False

    async def enter(self) -> None:
        await self._places.acquire()
        self._entered = True

    def nearly_free(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None

    def free(self) -> None:
        self.nearly_free()
        if self._entered:
            self._entered = False
            self._places.release()


class Worker:
    def __init__(
        self, config: WorkerConfig, engine: Engine, metrics: WorkerMetrics | None = None
    ) -> None:
        if config.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if config.prefetch_tokens < 0:
            raise ValueError("prefetch_tokens must be >= 0")
        self.config = config
        self.engine = engine
        self.stats = Stats()
        # Its Prometheus metrics (served only if the CLI was given --metrics-port).
        self.metrics = metrics or WorkerMetrics(engine=type(engine).__name__)
        self.metrics.worker = self
        self.heartbeat_round_trips = 0
        self.reaper: Reaper | None = None
        self.places = _Places(config.max_concurrency)  # replaced by each run's own
        self._queue_keys: dict[str, str] = {}  # queue name -> its rq list (for its depth)
        self._stopping = asyncio.Event()  # take no more jobs
        self._closing = asyncio.Event()  # background loops end
        # Failures per rollout on this worker that gave its job back (they set the backoff).
        self._failures: dict[str, int] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.admitting = asyncio.Event()  # cleared while weights are being swapped
        self.admitting.set()
        self._rq: RqBridge | None = None
        self.weights: WeightFollower | None = None
        self.checkpointer: Checkpointer | None = None  # while running: its round trips count

    @property
    def name(self) -> str:
        return self.config.name

    def request_stop(self) -> None:
        """Stop taking jobs; running rollouts save their progress and go back to the queue."""
        self._stopping.set()

    def engine_died(self, error: str) -> None:
        """The engine is gone for good: stop; every rollout here is saved and requeued."""
        if self.stats.engine_dead is None:
            log_event(
                log, logging.ERROR, "engine_dead", f"engine died ({error}): stopping this worker",
                worker=self.config.name, error=error,
            )  # fmt: skip
            self.stats.engine_dead = error
        self.request_stop()

    async def run(self) -> Stats:
        cfg = self.config
        client = connect(cfg.redis_url)
        store = EventStore(client)
        checkpointer = self.checkpointer = Checkpointer(store)
        checkpointer.observe = self.metrics.checkpoint_seconds.observe
        # Its leases are also listed under its name: found at once if its process dies.
        leases = Leases(client, store.keys, holder=cfg.name)
        self.runner = RolloutRunner(
            store,
            checkpointer,
            self.engine,
            cfg.name,
            cadence=cfg.cadence,
            stats=self.stats,
            weight_mode=cfg.weight_mode.value,
            leases=leases,
            lease_ttl_s=cfg.lease_ttl_s,
            model_id=cfg.model_id,
            max_worker_lost=cfg.max_worker_lost,
            stepped=cfg.stepped,
            prefetch_tokens=cfg.prefetch_tokens,
        )
        self.store = store
        rq = self._rq = RqBridge(
            cfg.redis_url,
            list(cfg.queues),
            cfg.name,
            execution_ttl_s=cfg.rq_execution_ttl_s,
            keys=self.store.keys,
        )
        self.weights_registry = WeightRegistry(client)
        self.weights = WeightFollower(self, self.weights_registry, cfg.weight_mode)
        await self.weights.catch_up()
        await rq.register()
        reaper = self.reaper = Reaper(
            store, leases, rq.connection, rq, max_worker_lost=cfg.max_worker_lost,
            worker_id=cfg.name, stats=self.stats,
            presence=PresenceWatch(client, store.keys, me=cfg.name),
        )  # fmt: skip
        # Subscribed while this process lives, on a connection of its own: the reapers see
        # its death the moment its kernel closes that connection (store/presence.py).
        presence = Presence(cfg.redis_url, cfg.name, store.keys)
        self._queue_keys = {q: rollout_queue(rq.connection, q).key for q in cfg.queues}
        # Background loops stop on this event, checked every iteration: a cancel alone can
        # be lost inside redis-py (seen: 15 in 400 with socket_timeout set), and a worker
        # waiting on a loop that never ends never exits.
        closing = self._closing
        loops = [
            asyncio.create_task(self._heartbeat(rq, leases, closing), name="heartbeat"),
            asyncio.create_task(self.weights.follow(closing), name="weights"),
            asyncio.create_task(reaper.run(cfg.reap_interval_s, closing), name="reaper"),
            asyncio.create_task(presence.hold(closing), name="presence"),
        ]
        log_event(
            log, logging.INFO, "worker_start",
            f"worker {cfg.name} on {', '.join(cfg.queues)}, model "
            f"{self.runner.model_id or '(unknown)'}, weights v{self.engine.weight_version}, up "
            f"to {cfg.max_concurrency} rollouts at once",
            worker=cfg.name, queues=list(cfg.queues), model=self.runner.model_id,
            engine=self.metrics.engine, weight_version=self.engine.weight_version,
            max_concurrency=cfg.max_concurrency,
        )  # fmt: skip
        try:
            await self._take_jobs(rq)
        finally:
            # The heartbeat goes on while the rollouts in flight save and give their jobs back
            # (their leases must not lapse meanwhile); everything else stops first.
            loops[1].cancel()
            loops[2].cancel()
            await self._shut_down(rq)
            closing.set()
            await _stop_all(loops, defaults.LOOP_STOP_S)
            # Gone from the stats at once; a killed worker's entry is pruned by some reaper.
            await _bounded(
                fleet.remove(client, store.keys, cfg.name), defaults.LOOP_STOP_S, "stats entry"
            )
            await _bounded(checkpointer.close(), defaults.LOOP_STOP_S, "checkpointer")
            await _bounded(presence.close(), defaults.LOOP_STOP_S, "presence connection")
            await _bounded(rq.close(), defaults.LOOP_STOP_S, "rq registration")
            await _bounded(client.aclose(), defaults.LOOP_STOP_S, "redis client")
            log_event(
                log, logging.INFO, "worker_stop",
                f"worker {cfg.name} stopped: {self.stats.tokens} tokens generated",
                worker=cfg.name, tokens=self.stats.tokens, ended=dict(self.stats.ended),
                engine_dead=self.stats.engine_dead,
            )  # fmt: skip
        return self.stats

    async def _take_jobs(self, rq: RqBridge) -> None:
        slots = asyncio.Semaphore(self.config.max_concurrency)
        places = self.places = _Places(self.config.max_concurrency)
        while not self._stopping.is_set():
            # Take jobs only with free slots (leave the rest to other workers), but wake up
            # for a shutdown request even while every slot is busy.
            if not await self._slot_or_stop(slots):
                break
            free = 1
            while free < TAKE_AT_ONCE and not slots.locked():
                await slots.acquire()  # free: returns at once
                free += 1
            await self.admitting.wait()  # no new work while weights are swapped
            try:
                taken = await rq.dequeue_many(
                    self.config.dequeue_timeout_s, free, await_start=False
                )
            except Exception:
                # Redis unreachable for longer than the client's own retries: keep the process
                # (and its engine) alive, the rollouts in flight keep buffering; try again.
                log.warning("cannot take jobs from Redis; retrying", exc_info=True)
                for _ in range(free):
                    slots.release()
                await asyncio.sleep(1.0)
                continue
            for _ in range(free - len(taken)):
                slots.release()
            if not taken and self.config.burst and not self.tasks:
                break
            for running in taken:
                if running.problem is None:
                    slot = _Slot(slots, places)
                    task = asyncio.create_task(self._run_job(rq, running, slot))
                    eid = running.execution.id
                    self.tasks[eid] = task
                    task.add_done_callback(lambda _t, eid=eid, s=slot: self._done(eid, s))
            # Jobs that are not rollout jobs (anyone who can write to Redis can enqueue
            # anything): to rq's failed registry with the reason, without a slot or a task.
            # After the good ones are running: a refusal may wait out a Redis outage.
            for running in taken:
                if running.problem is not None:
                    slots.release()
                    await self._refuse(rq, running, running.problem)

    async def _slot_or_stop(self, slots: asyncio.Semaphore) -> bool:
        """True with a slot acquired; False (holding none) once a stop was requested."""
        acquire = asyncio.ensure_future(slots.acquire())
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if acquire.done() and not acquire.cancelled():
            if self._stopping.is_set():
                slots.release()
                return False
            return True
        acquire.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquire
        if acquire.done() and not acquire.cancelled():
            slots.release()  # acquired just as it was cancelled
        return False

    def _done(self, execution_id: str, slot: _Slot) -> None:
        self.tasks.pop(execution_id, None)
        slot.free()

    async def _run_job(self, rq: RqBridge, running: TakenJob, slot: _Slot) -> None:
        rid = running.rollout_id
        free_slot = slot.free
        await self.admitting.wait()  # dequeued just as an update began: start on new weights
        try:
            # The slot frees as soon as a finished rollout's last events are stamped: the next
            # job's dequeue and start overlap this one's last round trip and rq bookkeeping
            # (about 6 round trips the engine would otherwise run one request short).
            result = await self.runner.run(rid, place=slot, queue=running.queue.name)
        except RolloutNotFound as exc:
            # Nothing to run, now or ever: the job goes to rq's failed registry with why.
            await self._refuse(rq, running, f"{exc}")
            return
        except CorruptRecord as exc:
            # Damaged bytes: no retry will read them. End the rollout where its snapshot still
            # can be (so a waiting trainer sees it fail), and fail the job with the reason.
            recorded = await self._fail_unreadable(rid, exc)
            await self._refuse(rq, running, f"unreadable rollout: {exc}", recorded=recorded)
            return
        except CodecError as exc:
            # An event type or schema newer than this code: a newer worker can run it (a
            # rolling upgrade). Back off and give the job back.
            await self._back_off(rq, running, free_slot, f"written by newer code: {exc}")
            return
        except Exception as exc:
            # Redis unreachable for longer than the client's retries, or a bug: the rollout
            # keeps what was saved. Give the job back after a backoff that grows with each
            # failure of this rollout here, so nothing spins.
            error = f"{type(exc).__name__}: {exc}"
            # log_event's fields, plus the traceback of what is not a plain outage.
            log.warning(
                "rollout %s: run failed (%s)", rid, error, exc_info=not _is_connection_error(exc),
                extra={"event": "run_error", "rollout_id": rid, "worker": self.config.name,
                       "error": error},
            )  # fmt: skip
            await self._back_off(rq, running, free_slot, f"{type(exc).__name__}: {exc}")
            return
        if result.outcome is not Outcome.WRONG_MODEL:
            self._failures.pop(rid, None)  # it ran (or ended): its backoff starts over
        try:
            await self._settle(rq, running, result, free_slot)
        except Exception as exc:
            # Reading the log for the retry budget or recording the failure met Redis gone:
            # never leave the job "started" and heartbeated with nobody on it; retry later.
            error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "rollout %s: settling its attempt failed (%s)", rid, error,
                exc_info=not _is_connection_error(exc),
                extra={"event": "settle_error", "rollout_id": rid, "worker": self.config.name,
                       "error": error},
            )  # fmt: skip
            await self._back_off(rq, running, free_slot, f"{type(exc).__name__}: {exc}")

    async def _settle(
        self,
        rq: RqBridge,
        running: TakenJob,
        result: RunResult,
        free_slot: Callable[[], None],
    ) -> None:
        """Tell rq how the attempt ended, and log what an operator should know."""
        rid, outcome, state = running.rollout_id, result.outcome, result.state
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        if outcome is Outcome.ENGINE_ERROR:
            errors = await self._engine_errors(rid)
            budget = self.config.max_engine_attempts
            if errors >= budget:
                await self._fail(state, result.error or "engine error", errors)
                why = f"rollout {rid} failed: {result.error}"
                await self._books(lambda: rq.fail(running, why), running)
                return
            log_event(
                log, logging.WARNING, "engine_error",
                f"rollout {rid} attempt {state.attempt}: engine error {errors} of {budget} on "
                f"{self.config.name}, retrying: {result.error}",
                rollout_id=rid, attempt=state.attempt, worker=self.config.name,
                errors=errors, budget=budget, error=result.error,
            )  # fmt: skip
            await self._give_back(rq, running, state.queue, at_front=False)
        elif outcome is Outcome.FAILED:
            # Recorded failed by the runner (a request error, or its worker-lost budget): a
            # failed rq job with the reason, like a rollout out of engine-error attempts.
            why = f"rollout {rid} failed: {result.error}"
            await self._books(lambda: rq.fail(running, why), running)
        elif outcome is Outcome.ENGINE_DEAD:
            self.engine_died(result.error or "engine died")
            # First in line for a worker with an engine.
            await self._give_back(rq, running, state.queue, at_front=True)
        elif outcome is Outcome.ABORTED:
            # Shutdown or weight update: first in line for the next worker on current weights.
            await self._give_back(rq, running, state.queue, at_front=True)
        elif outcome is Outcome.WRONG_QUEUE:
            log_event(
                log, logging.WARNING, "wrong_queue", f"rollout {rid}: {result.error}; moving "
                "the job there", rollout_id=rid, worker=self.config.name, queue=state.queue,
            )  # fmt: skip
            await self._give_back(rq, running, state.queue, at_front=True)
        elif outcome is Outcome.WRONG_MODEL:
            # Not ours to run: give it back, after a backoff, so a worker serving its model
            # takes it (on a queue that mixes models, which the queue was not meant to).
            await self._back_off(rq, running, free_slot, result.error or "wrong model")
        elif outcome is Outcome.LOST and state.terminal:
            # Ended from outside while generating here (a trainer's cancel fences the attempt):
            # the engine request is aborted, its saved tokens stay; not a failure of the job.
            log_event(
                log, logging.INFO, "ended_elsewhere",
                f"rollout {rid} ended {state.status.value} while generating on "
                f"{self.config.name} ({state.error or 'no reason given'}); job "
                f"{running.job.id} superseded",
                rollout_id=rid, attempt=state.attempt, worker=self.config.name,
                status=state.status.value, job=running.job.id,
            )  # fmt: skip
            await self._books(lambda: rq.supersede(running), running)
        elif outcome in (Outcome.LOST, Outcome.DUPLICATE):
            log_event(
                log, logging.INFO, "superseded",
                f"rollout {rid}: job {running.job.id} superseded ({outcome.value}): attempt "
                f"{state.attempt} of worker {state.worker_id} owns it",
                rollout_id=rid, attempt=state.attempt, worker=self.config.name,
                owner=state.worker_id, job=running.job.id, outcome=outcome.value,
            )  # fmt: skip
            await self._books(lambda: rq.supersede(running), running)
        else:
            summary = {"rollout_id": rid, "status": state.status.value, "outcome": outcome.value}
            await self._books(lambda: rq.succeed(running, summary), running)

    async def _refuse(
        self, rq: RqBridge, running: TakenJob, reason: str, *, recorded: bool = False
    ) -> None:
        self.stats.outcomes["refused"] = self.stats.outcomes.get("refused", 0) + 1
        log_event(
            log, logging.ERROR, "refused",
            f"job {running.job.id} (rollout {running.rollout_id or '?'}) refused"
            f"{', rollout recorded as failed' if recorded else ''}: {reason}",
            rollout_id=running.rollout_id, worker=self.config.name, job=running.job.id,
            error=reason,
        )  # fmt: skip
        await self._books(lambda: rq.fail(running, reason), running)

    async def _fail_unreadable(self, rid: str, exc: CodecError) -> bool:
        try:
            recorded = await self.store.fail_unreadable(rid, f"unreadable record: {exc}")
        except Exception:
            # Its snapshot is damaged too (or Redis went away): the failed job says why.
            log.warning("rollout %s: cannot record the failure", rid, exc_info=True)
            return False
        if recorded:
            self.stats.end(Status.FAILED, FailureClass.UNREADABLE)
        return recorded

    async def _back_off(
        self, rq: RqBridge, running: TakenJob, free_slot: Callable[[], None] | None, why: str
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
            rollout_id=rid, worker=self.config.name, error=why, seconds=delay, failures=n,
        )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)
        queue = None
        with contextlib.suppress(Exception):
            # The rollout's own queue, when it can be read; else the job's.
            queue = (await self.store.load(rid)).queue
        await self._give_back(rq, running, queue, at_front=False)

    async def _give_back(
        self, rq: RqBridge, running: TakenJob, queue: str | None, *, at_front: bool
    ) -> None:
        back = await self._books(
            lambda: rq.requeue(running, at_front=at_front, queue=queue), running
        )
        if back:
            log.debug("rollout %s: job back on %s", running.rollout_id, queue)

    async def _books(
        self, call: Callable[[], Awaitable[None]], job: TakenJob | None = None
    ) -> bool:
        """One piece of rq bookkeeping, retried with backoff through a Redis outage longer
        than the client's own retries: a job left "started" with nobody heartbeating it is
        later declared abandoned and failed by rq, whatever became of its rollout. Gives up
        (logged, False) after ``BOOKS_RETRY_S``, or ``LOOP_STOP_S`` once stopping. Every call
        is safe to repeat: the bridge acts only on a job still started by this execution."""
        deadline = time.monotonic() + defaults.BOOKS_RETRY_S
        delay = defaults.REQUEUE_BACKOFF_S
        while True:
            try:
                await call()
                return True
            except Exception:
                # Redis unreachable (rq's own bookkeeping raises nothing else here).
                left = deadline - time.monotonic()
                if self._stopping.is_set():
                    left = min(left, defaults.LOOP_STOP_S)
                if left <= 0:
                    log.error("rq bookkeeping failed; the job stays as rq last saw it",
                              exc_info=True)  # fmt: skip
                    if self._rq is not None and job is not None:
                        # No more heartbeats: rq calls it abandoned, a sweep gives it back.
                        self._rq.forget(job)
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
            await record_failure(
                self.store, state, error, FailureClass.ENGINE_ERROR, worker_id=self.config.name,
                why=f"after {errors} engine errors on {self.config.name}",
            )  # fmt: skip
        except AppendRefused:
            # It moved on meanwhile (cancelled, or taken over): nothing of ours to record.
            return
        self.stats.end(Status.FAILED, FailureClass.ENGINE_ERROR)

    async def _heartbeat(self, rq: RqBridge, leases: Leases, stop: asyncio.Event) -> None:
        beats = 0
        rq_s = min(defaults.RQ_HEARTBEAT_S, self.config.rq_execution_ttl_s / 3)
        rq_every = max(1, round(rq_s / self.config.heartbeat_s))
        while not stop.is_set():
            try:
                # Every lease this worker holds, renewed in one command.
                await leases.renew(self.runner.active, self.config.lease_ttl_s)
                if beats % rq_every == 0:
                    await rq.heartbeat()
                    self.heartbeat_round_trips += 1
                await fleet.beat(self.store.redis, self.store.keys, self._beat())
                self.heartbeat_round_trips += 2
                if self.metrics.served:
                    # Queue depth and weight lag: only for a scraper, and never per token.
                    await self.metrics.refresh(
                        self.store.redis, self._queue_keys, self.weights_registry
                    )
            except Exception:
                # A missed beat is survivable (the TTLs span several); keep beating.
                log.warning("heartbeat failed", exc_info=True)
            beats += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.heartbeat_s)

    def _beat(self) -> fleet.WorkerBeat:
        """What ``client.stats()`` shows of this worker: rollouts on its engine right now (inside
        the runner: opening, generating or saving), its weights and what it serves."""
        return fleet.WorkerBeat(
            worker_id=self.config.name,
            in_flight=len(self.runner.active),
            weight_version=self.engine.weight_version,
            queues=self.config.queues,
            model=self.runner.model_id,
        )

    async def _shut_down(self, rq: RqBridge) -> None:
        tasks = list(self.tasks.values())
        if not tasks:
            return
        log_event(
            log, logging.INFO, "worker_stopping",
            f"stopping {len(tasks)} rollouts: progress is saved and their jobs requeued",
            worker=self.config.name, in_flight=len(tasks),
        )  # fmt: skip
        for running in list(rq.running.values()):
            if running.rollout_id:
                await self.runner.stop(running.rollout_id, AbortReason.SHUTDOWN)
        _, pending = await asyncio.wait(tasks, timeout=self.config.shutdown_grace_s)
        if pending:
            log.warning("%d rollouts did not save within %.0f s; cancelling them",
                        len(pending), self.config.shutdown_grace_s)  # fmt: skip
            await _stop_all(list(pending), defaults.LOOP_STOP_S)


async def _stop_all(tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout_s``: a task that swallowed its
    cancel is logged and left behind rather than waited for forever."""
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        log.error("task %s did not stop within %.1f s; leaving it", task.get_name(), timeout_s)


async def _bounded(step: Awaitable[Any], timeout_s: float, what: str) -> None:
    """One shutdown step, at most ``timeout_s``; its failure is logged, never raised (the
    process is going away; nothing else must be skipped for it)."""
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        log.error("closing the %s took over %.1f s; going on", what, timeout_s)
    except Exception:
        # Redis gone during shutdown: whatever is left is recovered by leases and the reaper.
        log.warning("closing the %s failed", what, exc_info=True)


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError)
