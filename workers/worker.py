"""The worker process: one resident engine, up to N rollouts generating on it at once.

rq is the durable queue (jobs carry rollout ids only); this process never forks per job. Its
event loop takes a job only when one of its N slots is free, runs the rollout on the engine
through a ``RolloutRunner``, and keeps rq's registries truthful through ``RqBridge``. Every
rollout's progress goes to Redis through one group-commit ``Checkpointer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from statemachine import Aborted, AbortReason, Failed, RolloutState
from store import EventStore, defaults
from store.connection import connect
from store.leases import Leases
from store.weights import WeightRegistry
from workers.checkpoint import Checkpointer
from workers.engines.base import Engine
from workers.errors import EngineDead
from workers.reaper import Reaper
from workers.rq_bridge import RqBridge, Running
from workers.runner import Cadence, Outcome, RolloutRunner, Stats
from workers.weight_updates import WeightFollower, WeightMode

log = logging.getLogger("rollouts.worker")


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
    dequeue_timeout_s: int = defaults.DEQUEUE_TIMEOUT_S
    lease_ttl_s: float = defaults.LEASE_TTL_S
    heartbeat_s: float = defaults.HEARTBEAT_S  # lease renewal; rq's own heartbeat every 5th
    reap_interval_s: float = defaults.REAP_INTERVAL_S
    burst: bool = False  # exit once the queues are empty and nothing is running
    shutdown_grace_s: float = 30.0
    weight_mode: WeightMode = WeightMode.ABORT


class _Slot:
    """One of the worker's N places on the engine; released once, whoever releases first."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots: asyncio.Semaphore | None = slots

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        if config.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.config = config
        self.engine = engine
        self.stats = Stats()
        self._stopping = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.admitting = asyncio.Event()  # cleared while weights are being swapped
        self.admitting.set()
        self._rq: RqBridge | None = None
        self.weights: WeightFollower | None = None
        self.checkpointer: Checkpointer | None = None  # while running: its round trips count

    def request_stop(self) -> None:
        """Stop taking jobs; running rollouts save their progress and go back to the queue."""
        self._stopping.set()

    def engine_died(self, error: str) -> None:
        """The engine is gone for good: stop; every rollout here is saved and requeued."""
        if self.stats.engine_dead is None:
            log.error("engine died (%s): stopping this worker", error)
            self.stats.engine_dead = error
        self.request_stop()

    async def run(self) -> Stats:
        cfg = self.config
        client = connect(cfg.redis_url)
        store = EventStore(client)
        checkpointer = self.checkpointer = Checkpointer(store)
        leases = Leases(client)
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
        )
        self.store = store
        rq = self._rq = RqBridge(cfg.redis_url, list(cfg.queues), cfg.name)
        self.weights = WeightFollower(self, WeightRegistry(client), cfg.weight_mode)
        await self.weights.catch_up()
        await rq.register()
        beat = asyncio.create_task(self._heartbeat(rq, leases))
        follow = asyncio.create_task(self.weights.follow())
        reaper = Reaper(store, leases, rq.queues[0])
        reap = asyncio.create_task(reaper.run(cfg.reap_interval_s))
        log.info(
            "worker %s on %s, up to %d rollouts at once", cfg.name, cfg.queues, cfg.max_concurrency
        )
        try:
            await self._take_jobs(rq)
        finally:
            follow.cancel()
            reap.cancel()
            await self._shut_down(rq)
            beat.cancel()
            for task in (beat, follow, reap):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await checkpointer.close()
            await rq.close()
            await client.aclose()
        return self.stats

    async def _take_jobs(self, rq: RqBridge) -> None:
        slots = asyncio.Semaphore(self.config.max_concurrency)
        while not self._stopping.is_set():
            # Take a job only with a free slot (leave the rest to other workers), but wake up
            # for a shutdown request even while every slot is busy.
            if not await self._slot_or_stop(slots):
                break
            await self.admitting.wait()  # no new work while weights are swapped
            try:
                running = await rq.dequeue(self.config.dequeue_timeout_s)
            except Exception:
                # Redis unreachable for longer than the client's own retries: keep the process
                # (and its engine) alive, the rollouts in flight keep buffering; try again.
                log.warning("cannot take jobs from Redis; retrying", exc_info=True)
                slots.release()
                await asyncio.sleep(1.0)
                continue
            if running is None:
                slots.release()
                if self.config.burst and not self.tasks:
                    break
                continue
            slot = _Slot(slots)
            task = asyncio.create_task(self._run_job(rq, running, slot.release))
            self.tasks[running.execution.id] = task
            task.add_done_callback(lambda _t, eid=running.execution.id, s=slot: self._done(eid, s))

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
        slot.release()

    async def _run_job(self, rq: RqBridge, running: Running, free_slot: Callable[[], None]) -> None:
        rid = running.rollout_id
        await self.admitting.wait()  # dequeued just as an update began: start on new weights
        try:
            # The slot frees as soon as a finished rollout's last events are stamped: the next
            # job's dequeue and start overlap this one's last round trip and rq bookkeeping
            # (about 6 round trips the engine would otherwise run one request short).
            result = await self.runner.run(rid, on_engine_free=free_slot)
        except Exception as exc:
            # Redis unreachable or a bug: the rollout keeps what was saved; give the job back so
            # another run takes the rollout over from its last checkpoint.
            log.exception("rollout %s: %s; job returned to the queue", rid, exc)
            with contextlib.suppress(Exception):
                await rq.requeue(running, at_front=False)
            return
        outcome, state = result.outcome, result.state
        self.stats.outcomes[outcome] = self.stats.outcomes.get(outcome, 0) + 1
        if outcome is Outcome.ENGINE_ERROR:
            if await self._engine_errors(rid) >= self.config.max_engine_attempts:
                state = await self._fail(state, result.error or "engine error")
                await rq.fail(running, f"rollout {rid} failed: {result.error}")
                return
            await rq.requeue(running, at_front=False)  # another attempt, maybe elsewhere
        elif outcome is Outcome.ENGINE_DEAD:
            self.engine_died(result.error or "engine died")
            await rq.requeue(running, at_front=True)  # first in line for a worker with an engine
        elif outcome is Outcome.ABORTED:
            # Shutdown or weight update: first in line for the next worker on current weights.
            await rq.requeue(running, at_front=True)
        else:
            await rq.succeed(
                running, {"rollout_id": rid, "status": state.status.value, "outcome": outcome.value}
            )

    async def _engine_errors(self, rollout_id: str) -> int:
        """Attempts of the rollout that the engine failed on.

        Not ``state.attempt``: weight updates, shutdowns, lost workers and dead engines end
        attempts too, and none of them is the rollout's fault; an RL run that updates weights
        every step would otherwise fail a rollout on its first real error. Read from the log
        only on this (rare) path, so the snapshot needs no extra counter.
        """
        events = await self.store.events(rollout_id)
        return sum(
            1
            for e in events
            if isinstance(e, Aborted)
            and e.reason is AbortReason.ENGINE_ERROR
            and not e.detail.startswith(f"{EngineDead.__name__}:")  # the runner's wording
        )

    async def _fail(self, state: RolloutState, error: str) -> RolloutState:
        event = Failed(
            rollout_id=state.rollout_id, seq=state.seq + 1, error=error, attempts=state.attempt
        )
        return await self.store.append(state, event)

    async def _heartbeat(self, rq: RqBridge, leases: Leases) -> None:
        beats = 0
        while True:
            try:
                # Every lease this worker holds, renewed in one command.
                await leases.renew(self.runner.active, self.config.lease_ttl_s)
                if beats % 5 == 0:
                    await rq.heartbeat()
            except Exception:
                # A missed beat is survivable (the TTLs span several); keep beating.
                log.warning("heartbeat failed", exc_info=True)
            beats += 1
            await asyncio.sleep(self.config.heartbeat_s)

    async def _shut_down(self, rq: RqBridge) -> None:
        tasks = list(self.tasks.values())
        if not tasks:
            return
        log.info("stopping %d rollouts: progress is saved and their jobs requeued", len(tasks))
        for running in list(rq.running.values()):
            await self.runner.stop(running.rollout_id, AbortReason.SHUTDOWN)
        _, pending = await asyncio.wait(tasks, timeout=self.config.shutdown_grace_s)
        for task in pending:
            task.cancel()
