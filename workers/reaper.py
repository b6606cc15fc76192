"""The reaper: turns expired leases into ``aborted(worker_lost)`` and gives the work back.

Run by every worker; several at once are safe: the fenced append lets exactly one of them
record the abort, and a lease is removed (and the rollout re-enqueued) only by whoever removes
it first, and only if nobody renewed it since it was read. The reaper appends events; it never
edits state behind the log's back.

The job goes back and the lease goes in one atomic step (``store.queue.give_back``), after the
abort is recorded: an enqueue that fails (Redis out of memory) leaves the expired lease, so a
later pass finds the rollout again, sees it aborted already (no second ``Aborted``) and gives
it back then. Before, the lease went first and a failed enqueue stranded the rollout: aborted,
with no job and no lease, until an operator requeued it.

One bad rollout affects only itself: each expired lease is handled on its own, a transient
error leaves that lease for a later pass (after a backoff of its own, ``defaults.REAP_RETRY_S``,
while the others are reaped), and a rollout that cannot be read at all is quarantined (its
lease moved to the quarantine hash with the reason, logged once) so that it never again stands
in front of the leases behind it.

A worker whose process died need not wait for its leases to expire: its Redis connections closed
with it, and ``store.presence`` sees that. Beside its passes over expired leases the reaper runs
a presence check every ``PRESENCE_CHECK_S`` (one reaper of the fleet per interval does it) and
reaps at once, the same way, the leases of workers whose process is gone: only those whose live
attempt is still that worker's (a lease it left on a rollout someone else runs now is not
touched). A stalled or partitioned worker keeps its connections, so its leases expire by TTL.

A rollout whose workers keep dying under it fails with ``worker_lost`` once its budget is spent
(``workers.failures``). Every ``PRUNE_EVERY`` passes the reaper also drops the stats heartbeats
of workers gone quiet (``store.stats.prune``): a killed worker never removes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis import Redis as SyncRedis

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
from store import AppendRefused, EventStore, RolloutNotFound, defaults, scripts, stats
from store.errors import StoreUnwritable, unwritable
from store.leases import Leases
from store.logs import log_event
from store.presence import PresenceWatch
from store.queue import JobWriter, give_back, new_job_ids, push_jobs, rollout_queue
from store.tool_sweep import sweep_lost_calls, sweep_wall_time
from workers.backoff import Backoff
from workers.failures import record_failure, worker_lost_aborts
from workers.outbox_sweep import OutboxSweep
from workers.outcomes import Stats
from workers.rq_bridge import RqBridge
from workers.stranded import StrandedSweep

log = logging.getLogger("rollouts.reaper")

# Passes between two prunes of dead workers' heartbeats: a stale entry is already left out of
# ``read_stats``; removing it is housekeeping, worth one HGETALL every ~10 s, not every second.
PRUNE_EVERY = 10
# Rollouts of one gone worker reaped at once (each is a few round trips).
GONE_CONCURRENCY = 16
# Expired leases looked at per pass (oldest first), beside those waiting out a retry backoff.
PASS_LIMIT = 100


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
        presence: PresenceWatch | None = None,
        stranded: StrandedSweep | None = None,
        queue_apart: bool = False,
        outbox: OutboxSweep | None = None,
    ) -> None:
        self.store = store
        # rq's queue on a Redis of its own (store.queue_redis): a give back is ordered steps.
        self.queue_apart = queue_apart
        # The net for rollouts left waiting with no job (None: not run by this reaper).
        self.stranded = stranded
        # On Redis Cluster: completions left in the outboxes (None: one Redis, none).
        self.outbox = outbox
        # Other workers' presence: None, leases are recovered when they expire, only.
        self.presence = presence
        self.worker_id = worker_id  # the worker this reaper runs in (for its log lines)
        # Its worker's counters: the aborts and failures it records are that worker's.
        self.stats = stats if stats is not None else Stats()
        self.leases = leases
        self.connection = connection  # rq's (synchronous) connection
        self.jobs = jobs  # the worker's rq bridge: abandoned jobs of its queues go back
        self.max_worker_lost = max_worker_lost
        self._writers: dict[str, JobWriter] = {}  # queue name -> its jobs' fields
        # Rollouts whose reaping failed (their enqueue refused, Redis away): retried later.
        self._retry = Backoff(defaults.REAP_RETRY_S, defaults.REAP_RETRY_MAX_S)
        self.recovered = 0
        self.quarantined = 0
        self.recovered_gone = 0  # of ``recovered``: rollouts of workers whose process was gone
        self.lost_calls = 0  # tool calls whose environment runner was lost (store.tool_sweep)
        self.wall_time_ended = 0  # episodes ended waiting on a tool past their wall time
        # Lost runners' calls are swept every TOOL_SWEEP_S, not every pass: a runner's lease is
        # 15 s, so a pass a second would add a script call per worker per second for nothing.
        self.tool_sweep_s = defaults.TOOL_SWEEP_S
        self._swept_at = float("-inf")
        # True while the reaper must leave every lease alone: its worker sees Redis refusing
        # writes, or saw it too recently for the lapsed leases' workers to have renewed them
        # (``StoreCondition.settling``). Nobody can renew a lease during such an episode, so a
        # lease lapsed then says nothing about its worker. The lease scripts hold off the same
        # way after any refusal Redis counted, whoever's it was (lua/lease_grace.lua): a
        # reaper whose worker saw none still leaves the leases lapsed then alone.
        self.hold: Callable[[], bool] = lambda: False
        # Told of a write Redis refused for a condition of its own, instead of a traceback
        # (``StoreCondition.refused``: one line per episode, and ``hold`` from then on).
        self.on_refused: Callable[[StoreUnwritable, str], None] = lambda error, what: None

    async def reap_once(self) -> list[str]:
        """One pass over the expired leases; returns the rollouts given back to the queue."""
        given_back = []
        # Those waiting out a backoff are listed too, and skipped: however many there are,
        # PASS_LIMIT others are reaped behind them.
        limit = PASS_LIMIT + len(self._retry)
        expired = await self.leases.expired(limit)
        if len(expired) < limit:
            self._retry.keep_only(rid for rid, _ in expired)  # the rest are gone or renewed
        for rid, expiry in expired:
            if not self._retry.due(rid):
                continue
            try:
                if await self._reap_or_quarantine(rid, expiry):
                    given_back.append(rid)
                self._retry.done(rid)
            except Exception as exc:
                # Redis hiccup, its enqueue refused (out of memory) or a bug on this one
                # rollout: its lease is still expired, so a later pass tries again; the leases
                # behind it are not held up. Redis refusing writes is its worker's episode,
                # logged there once.
                delay = self._retry.failed(rid)
                if not self._refused(exc, "reaper"):
                    log.warning("rollout %s: reaping failed; retrying in %.1f s", rid, delay,
                                exc_info=True)  # fmt: skip
        await self._sweep_tool_calls()
        if self.jobs is not None:
            try:
                for job_id in await self.jobs.requeue_abandoned():
                    log.warning("job %s: abandoned by a dead worker, requeued", job_id)
            except Exception as exc:
                # Redis hiccup: the abandoned jobs are still there next pass.
                if not self._refused(exc, "reaper"):
                    log.warning("sweep of abandoned jobs failed", exc_info=True)
        self.recovered += len(given_back)
        return given_back

    async def _sweep_tool_calls(self) -> None:
        """Lost environment runners: their calls' effects are decided here too (every
        ``tool_sweep_s``), so a deployment recovers them whether or not its runners sweep;
        and episodes whose call no runner claimed within their wall time end."""
        if time.monotonic() - self._swept_at < self.tool_sweep_s:
            return
        try:
            self.lost_calls += len(await sweep_lost_calls(self.store))
            self.wall_time_ended += len(await sweep_wall_time(self.store))
            self._swept_at = time.monotonic()
        except Exception as exc:
            # Redis hiccup: the lapsed tool leases are still there next time.
            if not self._refused(exc, "reaper"):
                log.warning("sweep of lost tool calls failed", exc_info=True)

    async def _reap_or_quarantine(self, rid: str, expiry: int) -> bool:
        try:
            return await self._reap(rid, expiry)
        except CodecError as exc:
            await self._quarantine(rid, expiry, exc)
            return False

    def _refused(self, exc: BaseException, what: str) -> bool:
        """Whether ``exc`` is Redis refusing writes (out of memory, a failed disk write), told
        to ``on_refused``: not an error of the reaper's, nor worth a traceback."""
        refused = unwritable(exc)
        if refused is None:
            return False
        self.on_refused(refused, what)
        return True

    async def reap_gone(self) -> list[str]:
        """One presence check: the leases of workers whose process is gone, reaped now."""
        given_back: list[str] = []
        if self.presence is not None:
            for worker in await self.presence.gone():
                given_back += await self._reap_worker(worker)
        self.recovered += len(given_back)
        self.recovered_gone += len(given_back)
        return given_back

    async def _reap_worker(self, worker: str) -> list[str]:
        assert self.presence is not None
        held = await self.leases.held_by(worker)
        # A GPU worker dies with hundreds of rollouts: reaped side by side, a few at a time.
        slots = asyncio.Semaphore(GONE_CONCURRENCY)

        async def reap(rid: str) -> bool | None:
            async with slots:
                return await self._reap_held(rid, worker)

        done = await asyncio.gather(*(reap(rid) for rid in held))
        given_back = [rid for rid, ok in zip(held, done, strict=True) if ok]
        retry = any(ok is None for ok in done)
        if not retry:
            await self.leases.forget_holder(worker)
            await self.presence.forget(worker)
            # Out of the fleet's stats now, not when its heartbeat goes stale (15 s).
            await stats.remove(self.store.redis, self.store.keys, worker)
        log_event(
            log, logging.WARNING, "worker_gone",
            f"worker {worker}: its process is gone (its Redis connections closed); "
            f"{len(given_back)} of the {len(held)} rollouts it had leased requeued",
            worker=self.worker_id, lost_worker=worker, rollouts=given_back,
        )  # fmt: skip
        return given_back

    async def _reap_held(self, rid: str, worker: str) -> bool | None:
        """One rollout the gone ``worker`` had leased: True if given back, None to retry."""
        try:
            expiry = await self.leases.expiry(rid)
            return expiry is not None and await self._reap(rid, expiry, gone=worker)
        except CodecError:
            # Unreadable: the pass over expired leases quarantines it once its lease lapses.
            return False
        except Exception as exc:
            # Redis hiccup on this one: the worker is still gone at the next check. Had its
            # abort been recorded and its give back refused, the lease stays; the rollout is
            # then no longer the gone worker's live attempt, so the next check leaves it to the
            # passes over expired leases, which give it back once that lease lapses.
            if not self._refused(exc, "reaper"):
                log.warning("rollout %s: reaping failed; retrying next check", rid, exc_info=True)
            return None

    async def _reap(self, rid: str, expiry: int, *, gone: str = "") -> bool:
        """Abort (worker_lost), release and requeue one rollout whose lease ``expiry`` was read;
        ``gone``: the worker whose process is gone, whose lease it was (else: it expired)."""
        try:
            state = await self.store.load(rid)
        except RolloutNotFound:
            await self.leases.release_if_unchanged(rid, expiry)  # a deleted rollout
            return False
        if gone and (state.status not in LIVE or state.worker_id != gone):
            # Not (or no longer) an attempt of the gone worker: the lease may be a new
            # worker's, taken just before its attempt opens. Its expiry decides, as always.
            return False
        why = (
            f"process of {gone} gone (its Redis connections closed)"
            if gone
            else f"lease of {state.worker_id} expired"
        )
        if state.status in LIVE:
            try:
                state = await self._abort_lost(state, why)
            except AppendRefused:
                # It moved on since we read it (finished, or another reaper won): look again
                # next pass if the lease is still expired.
                return False
        if state.terminal:
            # Failed here (its worker-lost budget spent) or ended meanwhile: no job to give.
            await self.leases.release_if_unchanged(rid, expiry)
            return False
        # Its worker died holding its job: queue it again, on the queue it was submitted to
        # (so on workers serving its model), and the lease goes with the same step. If the
        # job in fact survived, the duplicate finds the rollout taken (or done) and does
        # nothing. A failure raises with the lease kept: a later pass finds it aborted and
        # only gives it back.
        if self.queue_apart:
            if not await self._give_back_apart(state, expiry):
                return False
        elif not await asyncio.to_thread(self._give_back, state, expiry):
            return False  # renewed meanwhile, or another reaper took it
        log_event(
            log, logging.WARNING, "reaped",
            f"rollout {rid} attempt {state.attempt}: {why}; aborted (worker_lost), requeued "
            f"on {state.queue}",
            rollout_id=rid, attempt=state.attempt, worker=self.worker_id,
            lost_worker=state.worker_id, reason=AbortReason.WORKER_LOST.value,
            queue=state.queue, how="process_gone" if gone else "lease_expired",
        )  # fmt: skip
        return True

    async def _abort_lost(self, state: RolloutState, why: str) -> RolloutState:
        """Record that the rollout's worker was lost; fail it if that spends its budget."""
        [lost] = commands.abort(state, AbortReason.WORKER_LOST, why)
        count = await worker_lost_aborts(self.store, state.rollout_id) + 1
        if count < self.max_worker_lost:
            aborted = await self.store.append(state, lost)
            self.stats.aborted(AbortReason.WORKER_LOST)
            return aborted
        error = (
            f"{count} workers were lost under this rollout (limit {self.max_worker_lost}); "
            f"the last was {state.worker_id} ({why})"
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
        except Exception as exc:
            # Redis unreachable: the stale heartbeats are still left out of the stats.
            if not self._refused(exc, "reaper"):
                log.warning("pruning dead workers' heartbeats failed", exc_info=True)
            return
        if gone:
            log.info("workers gone quiet, removed from the stats: %s", gone)

    def _give_back(self, state: RolloutState, expiry: int) -> bool:
        """In a thread (rq's connection is synchronous): ``store.queue.give_back``."""
        snapshot = self.leases.keys.snapshot(state.rollout_id)
        jobs = self._writer(state.queue)
        index = self.leases.index_of(state.rollout_id)
        return give_back(jobs, index, snapshot, state.rollout_id, expiry, at_front=True)

    async def _give_back_apart(self, state: RolloutState, expiry: int) -> bool:
        """``give_back`` with the queue on a Redis of its own: the lease released if unchanged
        (which of racing reapers gives it back), the job's id recorded on the snapshot, then
        the job pushed. A failure or a crash after the release leaves the rollout waiting with
        no job and no lease: the stranded sweep's to requeue (``workers.stranded``)."""
        rid = state.rollout_id
        if not await self.leases.release_if_unchanged(rid, expiry):
            return False  # renewed meanwhile, or another reaper took it
        [job_id] = new_job_ids(1)
        await scripts.RECORD_JOB(self.store.redis, [self.store.keys.snapshot(rid)], [job_id])
        jobs = await asyncio.to_thread(self._writer, state.queue)
        await asyncio.to_thread(push_jobs, jobs, [(job_id, rid)], at_front=True)
        return True

    def _writer(self, name: str) -> JobWriter:
        jobs = self._writers.get(name)
        if jobs is None:
            # Its template asks the server's version once: per queue, not per rollout.
            jobs = self._writers[name] = JobWriter(rollout_queue(self.connection, name))
        return jobs

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop`` is set (checked between passes, so a cancel that
        redis-py swallows cannot keep it running), and beside them the presence checks and the
        checks for stranded rollouts."""
        beside = []
        if self.presence is not None:
            beside.append(
                asyncio.create_task(self._watch(self.presence.check_s, stop), name="watch")
            )
        if self.stranded is not None:
            beside.append(asyncio.create_task(self.stranded.run(stop), name="stranded"))
        if self.outbox is not None:
            beside.append(asyncio.create_task(self.outbox.run(stop), name="outbox"))
        try:
            await self._passes(interval_s, stop)
        finally:
            for task in beside:
                task.cancel()
            if beside:
                await asyncio.wait(beside, timeout=defaults.LOOP_STOP_S)

    async def _passes(self, interval_s: float, stop: asyncio.Event) -> None:
        passes = 0
        while not stop.is_set():
            if self.hold():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
                continue
            try:
                await self.reap_once()
            except Exception as exc:
                # Redis unreachable (listing the leases failed): they are still there next pass.
                if not self._refused(exc, "reaper"):
                    log.warning("reaper pass failed", exc_info=True)
            if passes % PRUNE_EVERY == 0:
                await self._prune_workers()
            passes += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    async def _watch(self, every_s: float, stop: asyncio.Event) -> None:
        failing = False
        while not stop.is_set():
            if self.hold():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every_s)
                continue
            try:
                await self.reap_gone()
                failing = False
            except Exception as exc:
                # Redis unreachable: logged once per outage (this runs 4 times a second); the
                # passes over expired leases carry on regardless.
                refused = self._refused(exc, "presence check")
                if not failing and not refused:
                    log.warning("presence check failed; retrying", exc_info=True)
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
