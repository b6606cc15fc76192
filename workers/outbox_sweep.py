"""On Redis Cluster, completions whose appender died before delivering them (``store.outbox``)
are delivered by one reaper of the fleet per interval: the one that wins the interval's token,
as the stranded-rollout net's check is taken (``workers.stranded``).

A sweep reads all 16,384 slots' outboxes (one pipelined read per master), so it is run by one
process per interval, never by every worker. Entries younger than ``outbox.SWEEP_AFTER_MS``
are their appender's to deliver and left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from store import EventStore, defaults, outbox
from store.errors import StoreUnwritable, unwritable

log = logging.getLogger("rollouts.outbox")


class OutboxSweep:
    def __init__(
        self,
        store: EventStore,
        *,
        worker_id: str = "",
        every_s: float = defaults.OUTBOX_SWEEP_S,
        older_than_ms: int = outbox.SWEEP_AFTER_MS,
    ) -> None:
        assert store.on_cluster is not None, "an outbox exists on Redis Cluster only"
        self.store = store
        self.worker_id = worker_id
        self.every_s = every_s
        self.older_than_ms = older_than_ms  # younger entries are their appenders' to deliver
        self.delivered = 0
        # As the stranded net's (``Reaper.hold``, ``Reaper.on_refused``).
        self.hold: Callable[[], bool] = lambda: False
        self.on_refused: Callable[[StoreUnwritable, str], None] = lambda error, what: None

    async def check(self) -> int:
        """One sweep, if this worker wins the interval's token: the completions delivered."""
        store = self.store
        px = max(1, int(self.every_s * 1000))
        if not await store.redis.set(store.keys.outbox_sweep(), self.worker_id or "-", nx=True,
                                     px=px):  # fmt: skip
            return 0
        assert store.on_cluster is not None
        n = await outbox.sweep(
            store.on_cluster, store.keys, store.head, replicas=store.replicas_acked,
            older_than_ms=self.older_than_ms,
        )  # fmt: skip
        if n:
            log.warning("delivered %d completions their appenders left in the outbox", n)
        self.delivered += n
        return n

    async def run(self, stop: asyncio.Event) -> None:
        """A sweep every ``every_s`` until ``stop`` is set; a failure is retried next time."""
        failing = False
        while not stop.is_set():
            if not self.hold():
                try:
                    await self.check()
                    failing = False
                except Exception as exc:
                    refused = unwritable(exc)
                    if refused is not None:
                        self.on_refused(refused, "outbox sweep")
                    elif not failing:
                        log.warning("outbox sweep failed; retrying", exc_info=True)
                    failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
