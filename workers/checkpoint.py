"""Group commit for one worker: the appends of all its rollouts go to Redis in one round trip.

Each rollout hands over a chain of events (e.g. its buffered tokens, then ``Finished``) and
awaits the outcome; whatever is queued while a round trip is in flight goes in the next one.

The runners time their checkpoints together, at the worker's flush points (``request_flush``,
``flush_mark``; the policy is in ``workers.runner``). Each rollout joins a flush point when
its next chunk arrives, and streams deliver chunks at their own moments (an HTTP stream per
request; one frame per decode round elsewhere), so the checkpoints of one flush point go out
once every generating rollout (``generating``, kept by the runners) has joined, or
``gather_s`` after the point started, whichever is first. Everything else (a rollout's first
event, its last chain) goes out at once and takes whatever is queued with it. A worker with
N rollouts in flight thus costs about one round trip per flush point, not N.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from statemachine import Event, RolloutState
from store import EventStore, defaults

_Entry = tuple[RolloutState | None, Sequence[Event], "asyncio.Future[RolloutState]", bool]


class Checkpointer:
    def __init__(
        self, store: EventStore, *, gather_s: float = defaults.CHECKPOINT_GATHER_S
    ) -> None:
        self.store = store
        self.gather_s = gather_s
        self._queue: list[_Entry] = []
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()  # something that must not wait for a flush point
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        # The worker's flush points (see workers.runner): each rollout checkpoints at its next
        # chunk once this number differs from the one it last flushed at.
        self.flush_requests = 0
        self._requested_at = float("-inf")
        self.generating = 0  # rollouts streaming from the engine, each may join a flush point

    def request_flush(self) -> None:
        """Start a flush point: every rollout of the worker checkpoints at its next chunk."""
        self.flush_requests += 1
        self._requested_at = time.monotonic()

    def flush_mark(self, interval_s: float) -> int:
        """The current flush point; a new one starts if ``interval_s`` passed since the last."""
        if time.monotonic() - self._requested_at >= interval_s:
            self.request_flush()
        return self.flush_requests

    async def append(
        self, state: RolloutState | None, events: Sequence[Event], *, gather: bool = False
    ) -> RolloutState:
        """Append ``events`` in order; return the state after the last, or raise the refusal.

        ``gather``: a flush point's checkpoint, which may wait for the others of its point.
        """
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="checkpointer")
        future: asyncio.Future[RolloutState] = asyncio.get_running_loop().create_future()
        self._queue.append((state, events, future, gather))
        if not gather:
            self._urgent.set()
        self._wake.set()
        return await future

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            deadline = self._requested_at + self.gather_s
            while not self._urgent.is_set() and self._joined() < self.generating:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), left)
                self._wake.clear()
            self._urgent.clear()
            batch, self._queue = self._queue, []
            if batch:
                await self._flush(batch)

    def _joined(self) -> int:
        return sum(1 for entry in self._queue if entry[3])

    async def _flush(self, batch: list[_Entry]) -> None:
        try:
            results = await self.store.append_many(
                [(state, events) for state, events, _, _ in batch]
            )
        except Exception as exc:
            # Redis unreachable: every caller gets the error and may retry its chain as is,
            # which is safe because a repeated append is recognised and not applied twice.
            for _, _, future, _ in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.round_trips += 1
        for (_, _, future, _), result in zip(batch, results, strict=True):
            if future.done():
                continue  # its caller was cancelled meanwhile
            if isinstance(result, RolloutState):
                future.set_result(result)
            else:
                future.set_exception(result)
