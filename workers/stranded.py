"""The net under every path that gives a job back: waiting rollouts with no job, requeued.

Each path that gives a rollout's job back keeps something a later pass finds (the expired lease,
the lapsed rq execution, the job in rq's intermediate list or failed registry) until the job is
safely queued again. What no path can see is a job lost some other way: deleted by hand, lost
with writes a Redis restart did not keep (AOF ``everysec``), or stranded by an older version of
this code. Such a rollout waits (pending or aborted) with no job, and a trainer waiting for it
waits forever; ``rollouts stuck`` lists it, and this net requeues it without an operator.

Cost, in a healthy deployment: one reaper of the fleet per ``STRANDED_CHECK_S`` (a ``SET NX PX``
token) compares, in two round trips, the rollouts that need a job (pending, generating, aborted,
resumed: counters the append script keeps in the same step as each transition) with the jobs
that would run them (queued, being dequeued, started with a live heartbeat, on every rq queue).
Each such rollout has at least one of those jobs, so only a shortfall can hide a stranded one;
only then does it look for them (``store.inspect.find_stuck``: a SCAN of the snapshots and the
queues' lists, looked at twice), and a look that requeues nothing doubles the wait before the
next one (up to ``STRANDED_SCAN_MAX_S``): a shortfall it cannot act on (a dead worker's rollouts,
which the reaper takes back by their leases) costs a scan per ten minutes at most.

It requeues only waiting rollouts with no job (``no_job``), at the front of their own queue, as
``rollouts requeue`` does; live ones with a lapsed lease are the reaper's, quarantined ones an
operator's. A job that appears between its look and its requeue makes a duplicate, which the
fencing turns into a superseded job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from redis import Redis as SyncRedis
from rq import Queue

from statemachine import LIVE, WAITING, Status
from store import EventStore, defaults, slot_counters
from store.errors import StoreUnwritable, unwritable
from store.inspect import find_stuck
from store.logs import log_event
from store.queue import enqueue_rollouts, rollout_queue

log = logging.getLogger("rollouts.stranded")

# rq's set of queue keys (``Queue.redis_queues_keys``), and where a queue key's name begins.
_RQ_QUEUES = "rq:queues"
_RQ_QUEUE_PREFIX = "rq:queue:"


class StrandedSweep:
    def __init__(
        self,
        store: EventStore,
        connection: SyncRedis,
        *,
        worker_id: str = "",
        check_s: float = defaults.STRANDED_CHECK_S,
        scan_max_s: float = defaults.STRANDED_SCAN_MAX_S,
        store_connection: SyncRedis | None = None,
    ) -> None:
        self.store = store
        self.connection = connection  # rq's (synchronous) connection
        # The store's, synchronous, when the queue is on a Redis of its own (None: the same).
        self.store_connection = store_connection
        self.worker_id = worker_id
        self.check_s = check_s
        self.scan_max_s = scan_max_s
        self.scans = 0
        self.requeued = 0
        # As the reaper's (``Reaper.hold``, ``Reaper.on_refused``): no check while Redis
        # refuses writes (its token and its reads in a MULTI would be refused), and a refusal
        # told to the worker's episode instead of a traceback.
        self.hold: Callable[[], bool] = lambda: False
        self.on_refused: Callable[[StoreUnwritable, str], None] = lambda error, what: None

    async def check(self) -> list[str]:
        """One check, if this reaper wins this interval's token: the rollouts it requeued."""
        key = self.store.keys.stranded_check()
        px = max(1, int(self.check_s * 1000))
        if not await self.store.redis.set(key, self.worker_id or "-", nx=True, px=px):
            return []  # another reaper checks this interval
        # When the next look may be, and the wait before it: the fleet's, whichever reaper
        # wins the token (a hash without a TTL: the wait must outlive the interval).
        schedule = self.store.keys.stranded_scan()
        if await self.shortfall() <= 0:
            await self.store.redis.delete(schedule)  # nothing hidden: look at once next time
            return []
        if self.store.cluster:  # a cluster's pipelines refuse TIME: two round trips
            at, wait = await self.store.redis.hmget(schedule, ["at", "wait"])  # type: ignore[misc]
            sec, usec = await self.store.redis.time()
        else:
            async with self.store.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(schedule, ["at", "wait"])
                pipe.time()  # Redis's clock: the fleet's hosts' clocks need not agree
                (at, wait), (sec, usec) = await pipe.execute()
        now = int(sec) + int(usec) / 1e6
        if at is not None and now < float(at):
            return []
        requeued = await self.scan()
        # A look that requeued nothing waits twice as long as the last before the next.
        wait_s = self.check_s if requeued or wait is None else float(wait) * 2
        wait_s = min(self.scan_max_s, wait_s)
        next_look = {"at": now + wait_s, "wait": wait_s}
        await self.store.redis.hset(schedule, mapping=next_look)  # type: ignore[misc]
        return requeued

    async def shortfall(self) -> int:
        """Rollouts that need a job, less the jobs that would run them (<= 0: none hidden)."""
        keys = self.store.keys
        live = [s.value for s in Status if s in LIVE or s in WAITING]
        if self.store_connection is not None:
            # The queue apart (store.queue_redis): counters and jobs read one after the
            # other. A trigger only (the scan looks twice): no instant across both is needed.
            if self.store.on_cluster is not None:  # counted per slot (store.slot_counters)
                summed = await slot_counters.summed(self.store.on_cluster, keys)
                counts = [summed.get(name, 0) for name in live]
            else:
                counts = await self.store.redis.hmget(keys.stats(), live)  # type: ignore[misc]
            jobs = await asyncio.to_thread(self._jobs_waiting)
            return sum(int(c or 0) for c in counts) - jobs
        names = sorted(
            k.decode().removeprefix(_RQ_QUEUE_PREFIX)
            for k in await self.store.redis.smembers(_RQ_QUEUES)  # type: ignore[misc]
        )
        queues = [rollout_queue(self.connection, n) for n in names]
        now = time.time()
        async with self.store.redis.pipeline(transaction=True) as pipe:
            pipe.hmget(keys.stats(), live)
            for q in queues:
                _count_jobs(pipe, q, now)
            counts, *found = await pipe.execute()
        return sum(int(c or 0) for c in counts) - sum(int(j) for j in found)

    def _jobs_waiting(self) -> int:
        """The jobs queued, being dequeued or started (alive) on every rq queue, read on the
        queue's Redis in one MULTI."""
        names = sorted(
            k.decode().removeprefix(_RQ_QUEUE_PREFIX)
            for k in self.connection.smembers(_RQ_QUEUES)  # type: ignore[union-attr]
        )
        now = time.time()
        with self.connection.pipeline(transaction=True) as pipe:
            for n in names:
                _count_jobs(pipe, rollout_queue(self.connection, n), now)
            return sum(int(j) for j in pipe.execute())

    async def scan(self) -> list[str]:
        """Find the waiting rollouts with no job (looked at twice) and requeue each."""
        self.scans += 1
        requeued = []
        for s in await find_stuck(self.store, self.connection):
            if s.kind != "no_job" or s.queue is None or Status(s.status) not in WAITING:
                continue
            try:
                queue = rollout_queue(self.connection, s.queue)
                await asyncio.to_thread(
                    enqueue_rollouts,
                    queue,
                    [s.rollout_id],
                    at_front=True,
                    keys=self.store.keys,
                    store=self.store_connection,
                )
            except Exception:
                # Its enqueue refused (Redis out of memory): still stranded, so found again
                # by the next scan; the others are requeued meanwhile.
                log.warning("rollout %s: requeueing a stranded rollout failed", s.rollout_id,
                            exc_info=True)  # fmt: skip
                continue
            requeued.append(s.rollout_id)
            self.requeued += 1
            log_event(
                log, logging.WARNING, "stranded",
                f"rollout {s.rollout_id}: {s.why}; requeued on {s.queue}",
                rollout_id=s.rollout_id, worker=self.worker_id, queue=s.queue,
                status=s.status, tokens=s.tokens,
            )  # fmt: skip
        return requeued

    async def run(self, stop: asyncio.Event) -> None:
        """A check every ``check_s`` until ``stop`` is set; a failure is retried next time."""
        failing = False
        while not stop.is_set():
            if self.hold():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.check_s)
                continue
            try:
                await self.check()
                failing = False
            except Exception as exc:
                # Redis unreachable: logged once per outage; the next check tries again.
                refused = unwritable(exc)
                if refused is not None:
                    self.on_refused(refused, "stranded check")
                elif not failing:
                    log.warning("check for stranded rollouts failed; retrying", exc_info=True)
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.check_s)


def _count_jobs(pipe: Any, q: Queue, now: float) -> None:
    """Queue the reads of ``q``'s jobs that would run a rollout: queued, being dequeued, or
    started and alive (rq scores its started registry by the expiry of each run)."""
    pipe.llen(q.key)
    pipe.llen(q.intermediate_queue_key)
    pipe.zcount(q.started_job_registry.key, f"({now}", "+inf")
