"""Redis refusing a worker's writes for a condition of its own: an episode, not a failure.

Out of memory under ``noeviction``, a failed RDB/AOF write (MISCONF), a read-only replica
(``store.errors.StoreUnwritable``): Redis writes nothing and will accept the same write once
the condition clears. So a refused write is not the rollout's fault nor a lost worker, and
nothing is given up for it: the worker keeps every attempt and its unsaved tokens, retries
each refused write with capped backoff until Redis takes it (``until_written``), takes no new
job while the condition holds (``writable``), and charges no budget. Retrying is safe because
every write a worker repeats is recognised when repeated (appends by their sequence numbers
and records, leases and rq's bookkeeping by their own checks).

One ``StoreCondition`` per worker process counts and logs the episodes: one line when Redis
first refuses a write (event ``store_unwritable``) and one when it accepts them again
(``store_writable``), whatever number of writes were refused in between (before, each refused
checkpoint logged a traceback: 459 lines per worker in one OOM). A refused write that was sent
before the last episode ended (its reply arrived late) is counted but starts no new episode,
and only a write Redis refuses under every condition (``proves=True``: an append, a stats
heartbeat) ends one: a delete is allowed under OOM and would end it too early.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from store import defaults
from store.errors import StoreUnwritable, unwritable
from store.logs import log_event
from workers.gates import until_open

T = TypeVar("T")

log = logging.getLogger("rollouts.store")


class StoreCondition:
    def __init__(self, worker: str = "", *, retry_s: tuple[float, float] | None = None) -> None:
        self.worker = worker  # for its log lines
        self.retry_s = retry_s or defaults.STORE_RETRY_S
        self.refusal: StoreUnwritable | None = None  # the episode's first refusal, while it holds
        self.episodes = 0
        self.refused_writes = 0  # writes Redis refused (each retried), in every episode
        self._since = 0.0  # monotonic: when the current episode began
        self._ended = float("-inf")  # monotonic: when the last one ended
        self._refused_now = 0  # refused writes of the current episode
        self.writable = asyncio.Event()  # set while no episode holds: the worker takes jobs
        self.writable.set()

    @property
    def holds(self) -> bool:
        return self.refusal is not None

    def settling(self, grace_s: float = defaults.STORE_REAP_GRACE_S) -> bool:
        """An episode holds, or ended less than ``grace_s`` ago (the reaper waits then: leases
        lapsed while nobody could renew them, and their workers renew them meanwhile)."""
        return self.holds or time.monotonic() - self._ended < grace_s

    def refused(self, error: StoreUnwritable, what: str, sent: float | None = None) -> None:
        """Redis refused a write (``what``, for the log line) sent at ``sent`` (monotonic;
        None: now)."""
        self.refused_writes += 1
        if self.refusal is not None:
            self._refused_now += 1
            return
        if sent is not None and sent < self._ended:
            return  # sent before the last episode ended: its reply came late, not a new one
        self.refusal, self._since, self._refused_now = error, time.monotonic(), 1
        self.episodes += 1
        self.writable.clear()
        log_event(
            log, logging.WARNING, "store_unwritable",
            f"Redis refuses writes ({error.refusal.value}: {error.detail}); this worker keeps "
            f"its rollouts and their unsaved tokens, retries each refused write ({what} first) "
            "and takes no new job until Redis accepts writes again",
            worker=self.worker, refusal=error.refusal.value, error=error.detail, write=what,
        )  # fmt: skip

    def accepted(self, sent: float) -> None:
        """Redis accepted a write sent at ``sent`` (monotonic), one it refuses under every
        condition: the episode, if one holds and began before it was sent, is over."""
        error = self.refusal
        if error is None or sent < self._since:
            return
        now = time.monotonic()
        self.refusal, self._ended = None, now
        self.writable.set()
        log_event(
            log, logging.INFO, "store_writable",
            f"Redis accepts writes again after {now - self._since:.1f} s "
            f"({error.refusal.value}); {self._refused_now} refused writes retried; taking "
            "jobs again",
            worker=self.worker, refusal=error.refusal.value, seconds=round(now - self._since, 3),
            refused=self._refused_now,
        )  # fmt: skip

    async def until_written(
        self, write: Callable[[], Awaitable[T]], what: str, *, proves: bool = True
    ) -> T:
        """``write()`` until Redis accepts it: a refusal for a condition of Redis's own is
        counted and waited out with capped backoff; any other error is raised. ``proves``:
        Redis refuses this write under every condition, so its success ends an episode."""
        delay, cap = self.retry_s
        while True:
            sent = time.monotonic()
            try:
                result = await write()
            except Exception as exc:
                error = unwritable(exc)
                if error is None:
                    raise
                self.refused(error, what, sent)
                await asyncio.sleep(delay)
                delay = min(2 * delay, cap)
                continue
            if proves:
                self.accepted(sent)
            return result

    async def wait_writable(self, stop: asyncio.Event) -> bool:
        """Until no episode holds (True) or ``stop`` is set (False)."""
        return await until_open(self.writable, stop)
