"""The reaper: turns expired leases into ``aborted(worker_lost)`` and gives the work back.

Run by every worker (and any process that wants to: ``rollouts reaper``); several at once are
safe: the fenced append lets exactly one of them record the abort, and a lease is removed (and
the rollout re-enqueued) only by whoever removes it first, and only if nobody renewed it since
it was read. The reaper appends events; it never edits state behind the log's back.
"""

from __future__ import annotations

import asyncio
import logging

from rq import Queue

from statemachine import LIVE, Aborted, AbortReason
from store import AppendRefused, EventStore, RolloutNotFound
from store.leases import Leases
from store.queue import enqueue_rollouts_async

log = logging.getLogger("rollouts.reaper")


class Reaper:
    def __init__(self, store: EventStore, leases: Leases, queue: Queue) -> None:
        self.store = store
        self.leases = leases
        self.queue = queue
        self.recovered = 0

    async def reap_once(self) -> list[str]:
        """One pass over the expired leases; returns the rollouts given back to the queue."""
        given_back = []
        for rid, expiry in await self.leases.expired():
            try:
                state = await self.store.load(rid)
            except RolloutNotFound:
                await self.leases.release_if_unchanged(rid, expiry)  # a deleted rollout
                continue
            if state.status in LIVE:
                lost = Aborted(
                    rollout_id=rid,
                    seq=state.seq + 1,
                    attempt=state.attempt,
                    reason=AbortReason.WORKER_LOST,
                    detail=f"lease of {state.worker_id} expired",
                )
                try:
                    await self.store.append(state, lost)
                except AppendRefused:
                    # It moved on since we read it (finished, or another reaper won): look again
                    # next pass if the lease is still expired.
                    continue
            if not await self.leases.release_if_unchanged(rid, expiry):
                continue  # renewed meanwhile, or another reaper took it
            if not state.terminal:
                # Its worker died holding its job: queue it again. If the job in fact survived,
                # the duplicate finds the rollout taken (or done) and does nothing.
                await enqueue_rollouts_async(self.queue, [rid], at_front=True)
                given_back.append(rid)
                log.warning("rollout %s: lease expired, resuming it elsewhere", rid)
        self.recovered += len(given_back)
        return given_back

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.reap_once()
            except Exception:
                # Redis unreachable or a transient error: the leases are still there next pass.
                log.warning("reaper pass failed", exc_info=True)
            await asyncio.sleep(interval_s)
