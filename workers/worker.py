"""The worker process: one resident engine, up to N rollouts generating on it at once.

rq is the durable queue (jobs carry rollout ids only); this process never forks per job. Its
event loop takes a job only when one of its N slots is free (or about to be: a rollout with
``prefetch_tokens`` left; ``workers.places``), runs the rollout on the engine, never more than
N at once, through a ``RolloutRunner``, and keeps rq's registries truthful through ``RqBridge``
(how each job ends: ``workers.job_endings``). Every rollout's progress goes to Redis through
one group-commit ``Checkpointer``; its leases and rq's jobs stay alive through the heartbeat
(``workers.heartbeat``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from redis.asyncio import Redis

from statemachine import AbortReason, CodecError, CorruptRecord
from store import EventStore, RolloutNotFound, defaults, queue_redis
from store import stats as fleet
from store.connection import connect, connect_store
from store.errors import unwritable
from store.leases import Leases
from store.logs import log_event
from store.pause import PauseFlag
from store.presence import Presence, PresenceWatch
from store.queue import rollout_queue
from store.weights import WeightRegistry
from workers.checkpoint import Cadence, Checkpointer
from workers.engines.base import Engine
from workers.heartbeat import heartbeat
from workers.job_endings import JobEndings
from workers.metrics import WorkerMetrics
from workers.outbox_sweep import OutboxSweep
from workers.outcomes import Outcome, Stats
from workers.pausing import DeploymentPause
from workers.places import EnginePlaces, JobSlot
from workers.reaper import Reaper
from workers.rq_bridge import RqBridge, TakenJob
from workers.runner import RolloutRunner
from workers.shutdown import bounded, is_outage, stop_all
from workers.store_condition import StoreCondition
from workers.stranded import StrandedSweep
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
    # How often some reaper of the fleet checks for rollouts left waiting with no job.
    stranded_check_s: float = defaults.STRANDED_CHECK_S
    # A checkpoint counts as saved once this many replicas confirm it (WAIT; 0: once Redis
    # has it). Short, it is retried like a write Redis refuses: tokens kept, none sent twice.
    min_replicas_acked: int = 0
    # rq's queue, presence included, on a Redis of its own (store.queue_redis); None: the
    # store's (``redis_url``).
    queue_url: str | None = None


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
        self.places = EnginePlaces(config.max_concurrency)  # replaced by each run's own
        self.queue_keys: dict[str, str] = {}  # queue name -> its rq list (for its depth)
        self.queue_redis: Redis | None = None  # while running: where those lists are
        self._stopping = asyncio.Event()  # take no more jobs
        self._closing = asyncio.Event()  # background loops end
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.admitting = asyncio.Event()  # cleared while weights are being swapped
        self.admitting.set()
        # Redis refusing writes for a condition of its own (out of memory, a failed disk
        # write): its episodes, and whether jobs may be taken (workers/store_condition.py).
        self.condition = StoreCondition(config.name)
        # The deployment's pause (a harness's /pause), read with every heartbeat: while it
        # holds no job is taken (workers/pausing.py).
        self.pause = DeploymentPause(config.name)
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
        client = connect_store(cfg.redis_url)
        apart = queue_redis.apart(cfg.redis_url, cfg.queue_url)
        queue_url = cfg.queue_url if cfg.queue_url and apart else cfg.redis_url
        # The queue's Redis holds rq's keys and the fleet's presence (queue depths are read
        # there too); the store's holds everything durable.
        self.queue_redis = connect(queue_url) if apart else client
        store = EventStore(client, replicas_acked=cfg.min_replicas_acked)
        checkpointer = self.checkpointer = Checkpointer(store, condition=self.condition)
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
            # An episode between turns per slot: its turn's state, shared with its events.
            keep_turns=cfg.max_concurrency,
        )
        self.store = store
        rq = RqBridge(
            queue_url,
            list(cfg.queues),
            cfg.name,
            execution_ttl_s=cfg.rq_execution_ttl_s,
            keys=self.store.keys,
            store_url=cfg.redis_url if apart else None,
        )
        # How each job this run takes ends in rq's books (workers/job_endings.py).
        self.endings = JobEndings(
            rq, store, self.stats, self.condition, worker_id=cfg.name,
            max_engine_attempts=cfg.max_engine_attempts, stopping=self._stopping,
            engine_died=self.engine_died,
        )  # fmt: skip
        self.weights_registry = WeightRegistry(client)
        self.weights = WeightFollower(self, self.weights_registry, cfg.weight_mode)
        await self.weights.catch_up()
        await rq.register()
        # Before the first job: a worker started during a pause takes none (the heartbeat
        # keeps it current from here on).
        self.pause.follow(await PauseFlag(client, store.keys).current(), self.runner)
        stranded = StrandedSweep(
            store, rq.connection, worker_id=cfg.name, check_s=cfg.stranded_check_s,
            store_connection=rq.store_connection if apart else None,
        )  # fmt: skip
        reaper = self.reaper = Reaper(
            store, leases, rq.connection, rq, max_worker_lost=cfg.max_worker_lost,
            worker_id=cfg.name, stats=self.stats,
            presence=PresenceWatch(self.queue_redis, store.keys, me=cfg.name, store=client),
            stranded=stranded,
            queue_apart=apart,
        )  # fmt: skip
        # While Redis refuses writes the reaper's would be refused too; after, leases that
        # lapsed meanwhile get a grace to be renewed (defaults.STORE_REAP_GRACE_S).
        reaper.hold = stranded.hold = self.condition.settling
        reaper.on_refused = stranded.on_refused = self.condition.refused
        if store.cluster:
            sweep = reaper.outbox = OutboxSweep(store, worker_id=cfg.name)
            sweep.hold, sweep.on_refused = self.condition.settling, self.condition.refused
        # Subscribed while this process lives, on a connection of its own: the reapers see
        # its death the moment its kernel closes that connection (store/presence.py).
        presence = Presence(queue_url, cfg.name, store.keys)
        self.queue_keys = {q: rollout_queue(rq.connection, q).key for q in cfg.queues}
        # Background loops stop on this event, checked every iteration: a cancel alone can
        # be lost inside redis-py (seen: 15 in 400 with socket_timeout set), and a worker
        # waiting on a loop that never ends never exits.
        closing = self._closing
        loops = [
            asyncio.create_task(heartbeat(self, rq, leases, closing), name="heartbeat"),
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
            await stop_all(loops, defaults.LOOP_STOP_S)
            # Gone from the stats at once; a killed worker's entry is pruned by some reaper.
            await bounded(
                fleet.remove(client, store.keys, cfg.name), defaults.LOOP_STOP_S, "stats entry"
            )
            await bounded(checkpointer.close(), defaults.LOOP_STOP_S, "checkpointer")
            await bounded(presence.close(), defaults.LOOP_STOP_S, "presence connection")
            await bounded(rq.close(), defaults.LOOP_STOP_S, "rq registration")
            await bounded(client.aclose(), defaults.LOOP_STOP_S, "redis client")
            if apart:
                await bounded(self.queue_redis.aclose(), defaults.LOOP_STOP_S, "queue client")
            log_event(
                log, logging.INFO, "worker_stop",
                f"worker {cfg.name} stopped: {self.stats.tokens} tokens generated",
                worker=cfg.name, tokens=self.stats.tokens, ended=dict(self.stats.ended),
                engine_dead=self.stats.engine_dead,
            )  # fmt: skip
        return self.stats

    async def _take_jobs(self, rq: RqBridge) -> None:
        slots = asyncio.Semaphore(self.config.max_concurrency)
        places = self.places = EnginePlaces(self.config.max_concurrency)
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
            taken = await self._dequeue(rq, free)
            if taken is None:
                for _ in range(free):
                    slots.release()
                continue
            for _ in range(free - len(taken)):
                slots.release()
            if not taken and self.config.burst and not self.tasks:
                break
            for running in taken:
                if running.problem is None:
                    slot = JobSlot(slots, places)
                    task = asyncio.create_task(self._run_job(running, slot))
                    eid = running.execution.id
                    self.tasks[eid] = task
                    task.add_done_callback(functools.partial(self._done, eid, slot))
            # Jobs that are not rollout jobs (anyone who can write to Redis can enqueue
            # anything): to rq's failed registry with the reason, without a slot or a task.
            # After the good ones are running: a refusal may wait out a Redis outage.
            for running in taken:
                if running.problem is not None:
                    slots.release()
                    await self.endings.refuse(running, running.problem)

    async def _dequeue(self, rq: RqBridge, free: int) -> list[TakenJob] | None:
        """Up to ``free`` jobs (maybe none), or None when none could be taken (the caller's
        slots are all given back; a stop request ends the loop)."""
        # Nor while Redis refuses writes: a new rollout could not even be leased, and the
        # memory (or disk) a condition lacks goes to the rollouts already running.
        if not await self.condition.wait_writable(self._stopping):
            return None
        # Nor while the deployment is paused: its jobs stay queued, for any worker after
        # /resume (the slots wait here with the loop).
        if not await self.pause.wait_admitting(self._stopping):
            return None
        sent = time.monotonic()
        try:
            return await rq.dequeue_many(self.config.dequeue_timeout_s, free, await_start=False)
        except Exception as exc:
            refused = unwritable(exc)
            if refused is not None:
                # Redis refuses writes (a dequeue moves the job): the next take waits it out.
                self.condition.refused(refused, "dequeue", sent)
                return None
            # Redis unreachable for longer than the client's own retries: keep the process
            # (and its engine) alive, the rollouts in flight keep buffering; try again.
            log.warning("cannot take jobs from Redis; retrying", exc_info=True)
            await asyncio.sleep(1.0)
            return None

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

    def _done(self, execution_id: str, slot: JobSlot, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(execution_id, None)
        slot.free()

    async def _run_job(self, running: TakenJob, slot: JobSlot) -> None:
        rid = running.rollout_id
        free_slot = slot.free
        await self.admitting.wait()  # dequeued just as an update began: start on new weights
        # Dequeued just as Redis began refusing writes: its first read (a MULTI, which Redis
        # refuses out of memory) and its lease wait for it to accept them again.
        await self.condition.wait_writable(self._stopping)
        if self.pause.holds:
            # Dequeued just before this worker saw the deployment's pause: back to the front
            # of its queue unopened (nothing recorded, nothing charged). Checked with no await
            # before ``runner.run`` takes it in, so a pause in mode abort stops what got in.
            free_slot()
            await self.endings.give_back(running, None, at_front=True)
            return
        try:
            # The slot frees as soon as a finished rollout's last events are stamped: the next
            # job's dequeue and start overlap this one's last round trip and rq bookkeeping
            # (about 6 round trips the engine would otherwise run one request short).
            result = await self.runner.run(rid, place=slot, queue=running.queue.name)
        except RolloutNotFound as exc:
            # Nothing to run, now or ever: the job goes to rq's failed registry with why.
            await self.endings.refuse(running, f"{exc}")
            return
        except CorruptRecord as exc:
            # Damaged bytes: no retry will read them. End the rollout where its snapshot still
            # can be (so a waiting trainer sees it fail), and fail the job with the reason.
            recorded = await self.endings.fail_unreadable(rid, exc)
            await self.endings.refuse(running, f"unreadable rollout: {exc}", recorded=recorded)
            return
        except CodecError as exc:
            # An event type or schema newer than this code: a newer worker can run it (a
            # rolling upgrade). Back off and give the job back.
            await self.endings.back_off(running, free_slot, f"written by newer code: {exc}")
            return
        except Exception as exc:
            # Redis unreachable for longer than the client's retries, or a bug: the rollout
            # keeps what was saved. Give the job back after a backoff that grows with each
            # failure of this rollout here, so nothing spins.
            error = f"{type(exc).__name__}: {exc}"
            # log_event's fields, plus the traceback of what is not a plain outage.
            log.warning(
                "rollout %s: run failed (%s)", rid, error, exc_info=not is_outage(exc),
                extra={"event": "run_error", "rollout_id": rid, "worker": self.config.name,
                       "error": error},
            )  # fmt: skip
            await self.endings.back_off(running, free_slot, f"{type(exc).__name__}: {exc}")
            return
        if result.outcome is not Outcome.WRONG_MODEL:
            self.endings.ran(rid)  # it ran (or ended): its backoff starts over
        try:
            await self.endings.settle(running, result, free_slot)
        except Exception as exc:
            # Reading the log for the retry budget or recording the failure met Redis gone:
            # never leave the job "started" and heartbeated with nobody on it; retry later.
            error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "rollout %s: settling its attempt failed (%s)", rid, error,
                exc_info=not is_outage(exc),
                extra={"event": "settle_error", "rollout_id": rid, "worker": self.config.name,
                       "error": error},
            )  # fmt: skip
            await self.endings.back_off(running, free_slot, f"{type(exc).__name__}: {exc}")

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
            await stop_all(list(pending), defaults.LOOP_STOP_S)
