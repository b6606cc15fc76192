"""The reaper: turns expired leases into ``aborted(worker_lost)`` and gives the work back.

Run by every worker; several at once are safe: the fenced append lets exactly one of them
record the abort, and a lease is removed (and the rollout re-enqueued) only by whoever removes
it first, and only if nobody renewed it since it was read. The reaper appends events; it never
edits state behind the log's back.

One bad rollout affects only itself: each expired lease is handled on its own, a transient
error leaves that lease for the next pass, and a rollout that cannot be read at all is
quarantined (its lease moved to the quarantine hash with the reason, logged once) so that it
never again stands in front of the leases behind it.

A rollout whose workers keep dying under it fails with ``worker_lost`` once its budget is spent
(``workers.failures``). Every ``PRUNE_EVERY`` passes the reaper also drops the stats heartbeats
of workers gone quiet (``store.stats.prune``): a killed worker never removes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis import Redis as SyncRedis
from rq import Queue

from statemachine import (
    LIVE,
    AbortReason,
    CodecError,
    CorruptRecord,
    FailureClass,
    RolloutState,
    Status,
    commands,
)
from store import AppendRefused, EventStore, RolloutNotFound, defaults, stats
from store.leases import Leases
from store.logs import log_event
from store.queue import enqueue_rollouts_async, rollout_queue
from workers.failures import record_failure, worker_lost_aborts
from workers.rq_bridge import RqBridge
from workers.runner import Stats

log = logging.getLogger("rollouts.reaper")

# Passes between two prunes of dead workers' heartbeats: a stale entry is already left out of
# ``read_stats``; removing it is housekeeping, worth one HGETALL every ~10 s, not every second.
PRUNE_EVERY = 10


class Reaper:
    def __init__(
        self,
        store: EventStore,
        leases: Leases,
        connection: SyncRedis,
        jobs: RqBridge | None = None,
        *,
        max_worker_lost: int = defaults.MAX_WORKER_LOST,
        worker_id: str = "",
        stats: Stats | None = None,
    ) -> None:
        self.store = store
        self.worker_id = worker_id  # the worker this reaper runs in (for its log lines)
        # Its worker's counters: the aborts and failures it records are that worker's.
        self.stats = stats if stats is not None else Stats()
        self.leases = leases
        self.connection = connection  # rq's (synchronous) connection
        self.jobs = jobs  # the worker's rq bridge: abandoned jobs of its queues go back
        self.max_worker_lost = max_worker_lost
        self._queues: dict[str, Queue] = {}
        self.recovered = 0
        self.quarantined = 0

    async def reap_once(self) -> list[str]:
        """One pass over the expired leases; returns the rollouts given back to the queue."""
        given_back = []
        for rid, expiry in await self.leases.expired():
            try:
                if await self._reap(rid, expiry):
                    given_back.append(rid)
            except CodecError as exc:
                await self._quarantine(rid, expiry, exc)
            except Exception:
                # Redis hiccup or a bug on this one rollout: its lease is still expired, so
                # the next pass tries again; the leases behind it are not held up.
                log.warning("rollout %s: reaping failed; retrying next pass", rid, exc_info=True)
        if self.jobs is not None:
            try:
                for job_id in await self.jobs.requeue_abandoned():
                    log.warning("job %s: abandoned by a dead worker, requeued", job_id)
            except Exception:
                # Redis hiccup: the abandoned jobs are still there next pass.
                log.warning("sweep of abandoned jobs failed", exc_info=True)
        self.recovered += len(given_back)
        return given_back

    async def _reap(self, rid: str, expiry: int) -> bool:
        try:
            state = await self.store.load(rid)
        except RolloutNotFound:
            await self.leases.release_if_unchanged(rid, expiry)  # a deleted rollout
            return False
        if state.status in LIVE:
            try:
                state = await self._abort_lost(state)
            except AppendRefused:
                # It moved on since we read it (finished, or another reaper won): look again
                # next pass if the lease is still expired.
                return False
        if not await self.leases.release_if_unchanged(rid, expiry):
            return False  # renewed meanwhile, or another reaper took it
        if state.terminal:
            return False
        # Its worker died holding its job: queue it again, on the queue it was submitted to
        # (so on workers serving its model). If the job in fact survived, the duplicate finds
        # the rollout taken (or done) and does nothing.
        await enqueue_rollouts_async(self._queue(state), [rid], at_front=True)
        log_event(
            log, logging.WARNING, "reaped",
            f"rollout {rid} attempt {state.attempt}: lease of worker {state.worker_id} "
            f"expired; aborted (worker_lost), requeued on {state.queue}",
            rollout_id=rid, attempt=state.attempt, worker=self.worker_id,
            lost_worker=state.worker_id, reason=AbortReason.WORKER_LOST.value,
            queue=state.queue,
        )  # fmt: skip
        return True

    async def _abort_lost(self, state: RolloutState) -> RolloutState:
        """Record that the rollout's worker was lost; fail it if that spends its budget."""
        [lost] = commands.abort(
            state, AbortReason.WORKER_LOST, f"lease of {state.worker_id} expired"
        )
        count = await worker_lost_aborts(self.store, state.rollout_id) + 1
        if count < self.max_worker_lost:
            aborted = await self.store.append(state, lost)
            self.stats.aborted(AbortReason.WORKER_LOST)
            return aborted
        error = (
            f"{count} workers were lost under this rollout (limit {self.max_worker_lost}); "
            f"the last was {state.worker_id}, whose lease expired"
        )
        failed = await record_failure(
            self.store, state, error, FailureClass.WORKER_LOST, before=[lost],
            worker_id=self.worker_id,
        )  # fmt: skip
        self.stats.aborted(AbortReason.WORKER_LOST)
        self.stats.end(Status.FAILED, FailureClass.WORKER_LOST)
        return failed

    async def _quarantine(self, rid: str, expiry: int, exc: CodecError) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, CorruptRecord):
            # Record the failure where the snapshot is still readable, so that the trainer
            # sees the rollout end instead of waiting for it forever.
            with contextlib.suppress(Exception):
                if await self.store.fail_unreadable(rid, f"unreadable record: {reason}"):
                    self.stats.end(Status.FAILED, FailureClass.UNREADABLE)
        if await self.leases.quarantine(rid, expiry, reason):
            self.quarantined += 1
            log_event(
                log, logging.ERROR, "quarantine",
                f"rollout {rid}: cannot be read, quarantined ({reason})",
                rollout_id=rid, worker=self.worker_id, error=reason,
            )  # fmt: skip

    async def _prune_workers(self) -> None:
        try:
            gone = await stats.prune(self.store.redis, self.store.keys)
        except Exception:
            # Redis unreachable: the stale heartbeats are still left out of the stats.
            log.warning("pruning dead workers' heartbeats failed", exc_info=True)
            return
        if gone:
            log.info("workers gone quiet, removed from the stats: %s", gone)

    def _queue(self, state: RolloutState) -> Queue:
        queue = self._queues.get(state.queue)
        if queue is None:
            queue = self._queues[state.queue] = rollout_queue(self.connection, state.queue)
        return queue

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop`` is set (checked between passes, so a cancel that
        redis-py swallows cannot keep it running)."""
        passes = 0
        while not stop.is_set():
            try:
                await self.reap_once()
            except Exception:
                # Redis unreachable (listing the leases failed): they are still there next pass.
                log.warning("reaper pass failed", exc_info=True)
            if passes % PRUNE_EVERY == 0:
                await self._prune_workers()
            passes += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
