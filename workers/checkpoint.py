"""Group commit for one worker: the appends of all its rollouts go to Redis in one round trip.

Each rollout hands over a chain of events (e.g. its buffered tokens, then ``Finished``) and
awaits the outcome; whatever is queued while a round trip is in flight goes in the next one.
A worker with N rollouts in flight thus costs about one round trip per checkpoint interval,
not N.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from statemachine import Event, RolloutState
from store import EventStore

_Entry = tuple[RolloutState | None, Sequence[Event], "asyncio.Future[RolloutState]"]


class Checkpointer:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._queue: list[_Entry] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0

    async def append(self, state: RolloutState | None, events: Sequence[Event]) -> RolloutState:
        """Append ``events`` in order; return the state after the last, or raise the refusal."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="checkpointer")
        future: asyncio.Future[RolloutState] = asyncio.get_running_loop().create_future()
        self._queue.append((state, events, future))
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
            batch, self._queue = self._queue, []
            if batch:
                await self._flush(batch)

    async def _flush(self, batch: list[_Entry]) -> None:
        try:
            results = await self.store.append_many([(state, events) for state, events, _ in batch])
        except Exception as exc:
            # Redis unreachable: every caller gets the error and may retry its chain as is,
            # which is safe because a repeated append is recognised and not applied twice.
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.round_trips += 1
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue  # its caller was cancelled meanwhile
            if isinstance(result, RolloutState):
                future.set_result(result)
            else:
                future.set_exception(result)
