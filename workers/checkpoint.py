"""Group commit for one worker: the appends of all its rollouts go to Redis in one round trip.

Each rollout hands over a chain of events (e.g. its buffered tokens, then ``Finished``) and
awaits the outcome; whatever is queued while a round trip is in flight goes in the next one.

The worker's rollouts checkpoint together, at flush points, and the policy lives here
(``flush_due``): a flush point starts when any rollout holds ``Cadence.tokens`` unsaved
tokens, or ``Cadence.interval_s`` after the last one; every rollout joins it at its next
chunk with what it has. So no rollout holds more than ``tokens`` tokens or ``interval_s``
seconds unsaved (plus what arrives while its previous checkpoint is in flight), and the worker
makes about one round trip per flush point, not one per rollout. Streams deliver chunks at
their own moments (an HTTP stream per request; one frame per decode round elsewhere), so the
checkpoints of one flush point go out once every generating rollout (counted by
``streaming``) has joined, or ``gather_s`` after the point started, whichever is first.
Everything else (a rollout's first event, its last chain) goes out at once and takes whatever
is queued with it.

Why flush points shared by the worker and not a timer per rollout: rollouts start at
different moments, so their own timers and token counts come due at different moments and
most checkpoints were a round trip of their own. Measured (``bench/bench_overhead.py``, 64 x
256 tokens, 8 in flight): 960 appends in 614-797 round trips per round before, ~1,015 in
~230 with shared flush points.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from statemachine import Event, RolloutState
from store import EventStore, defaults
from store.scripts import Step
from workers.store_condition import StoreCondition

# (state, events, its future, gathered at a flush point, steps to run first: ``append``)
_Entry = tuple[
    RolloutState | None, Sequence[Event], "asyncio.Future[RolloutState]", bool, Sequence[Step]
]


@dataclass(frozen=True, slots=True)
class Cadence:
    """At most ``tokens`` tokens or ``interval_s`` seconds of a rollout's progress unsaved."""

    tokens: int = defaults.CHECKPOINT_TOKENS
    interval_s: float = defaults.CHECKPOINT_INTERVAL_S


class Checkpointer:
    def __init__(
        self,
        store: EventStore,
        *,
        cadence: Cadence | None = None,
        gather_s: float = defaults.CHECKPOINT_GATHER_S,
        condition: StoreCondition | None = None,
    ) -> None:
        """``condition``: the worker's (``workers.store_condition``); a round trip Redis refuses
        for a condition of its own is retried until it is accepted."""
        self.store = store
        self.condition = condition or StoreCondition()
        self.cadence = cadence or Cadence()
        self.gather_s = gather_s
        self._queue: list[_Entry] = []
        self._gathered = 0  # entries of ``_queue`` that joined a flush point (``gather``)
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()  # something that must not wait for a flush point
        self._task: asyncio.Task[None] | None = None
        self.round_trips = 0
        # Given each round trip's seconds (the worker's checkpoint latency histogram): one
        # call per group commit, never per token.
        self.observe: Callable[[float], None] | None = None
        # The worker's flush points, numbered: each rollout checkpoints at its next chunk once
        # the current number differs from the one it last flushed at.
        self.flush_points = 0
        self._started_at = float("-inf")
        self._streaming = 0  # rollouts streaming from the engine, each may join a flush point

    @property
    def generating(self) -> int:
        """Rollouts whose engine stream is open (a flush point waits for each to join)."""
        return self._streaming

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Around a rollout's engine stream: while open, flush points wait for it."""
        self._streaming += 1
        try:
            yield
        finally:
            self._streaming -= 1

    def start_flush_point(self) -> None:
        """Every rollout of the worker checkpoints at its next chunk."""
        self.flush_points += 1
        self._started_at = time.monotonic()

    def flush_point(self) -> int:
        """The current flush point; a new one starts if ``interval_s`` passed since the last."""
        if time.monotonic() - self._started_at >= self.cadence.interval_s:
            self.start_flush_point()
        return self.flush_points

    def flush_due(self, buffered: int, flushed: int, *, ready: bool) -> int | None:
        """The flush-point policy for one rollout at a new chunk: the flush point to
        checkpoint at now, or None. ``buffered``: its unsaved tokens; ``flushed``: the point
        it last checkpointed at; ``ready``: its previous checkpoint is no longer in flight."""
        full = buffered >= self.cadence.tokens
        joining = self.flush_point() != flushed
        if not (full or joining) or not ready:
            return None
        if full and not joining:
            # A new flush point: the worker's other rollouts join this commit. One that is full
            # just as it sees another's point joins it instead, or two groups a chunk apart
            # would keep pulling each other's 1-token buffers (measured: 1.8x the events).
            self.start_flush_point()
        return self.flush_points

    async def append(
        self,
        state: RolloutState | None,
        events: Sequence[Event],
        *,
        gather: bool = False,
        before: Sequence[Step] = (),
    ) -> RolloutState:
        """Append ``events`` in order; return the state after the last, or raise the refusal.

        ``gather``: a flush point's checkpoint, which may wait for the others of its point.
        ``before``: steps that run first in the same transaction if the events are sent (an
        attempt's lease with the event that opens it, ``Leases.take_steps``).
        """
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="checkpointer")
        future: asyncio.Future[RolloutState] = asyncio.get_running_loop().create_future()
        self._queue.append((state, events, future, gather, before))
        if gather:
            self._gathered += 1
        else:
            self._urgent.set()
        self._wake.set()
        return await future

    def submit(
        self, chains: Sequence[tuple[RolloutState, Sequence[Event]]]
    ) -> list[asyncio.Future[RolloutState]]:
        """Queue the chains of a whole flush point at once (``workers.stepper``, which knows
        every joiner already): they go out in the next round trip without gathering. Each
        future gets the state after its chain, or the refusal."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="checkpointer")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[RolloutState]] = []
        for state, events in chains:
            future: asyncio.Future[RolloutState] = loop.create_future()
            self._queue.append((state, events, future, False, ()))
            futures.append(future)
        self._urgent.set()
        self._wake.set()
        return futures

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
            deadline = self._started_at + self.gather_s
            while not self._urgent.is_set() and self._joined() < self.generating:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), left)
                self._wake.clear()
            self._urgent.clear()
            batch, self._queue, self._gathered = self._queue, [], 0
            if batch:
                await self._flush(batch)

    def _joined(self) -> int:
        # Counted as entries come, not by scanning the queue at every wake-up: with hundreds
        # of rollouts in flight the scan was quadratic per flush point.
        return self._gathered

    async def _flush(self, batch: list[_Entry]) -> None:
        chains = [(state, events) for state, events, _, _, _ in batch]
        before = [steps for *_, steps in batch] if any(e[4] for e in batch) else []
        t0 = time.perf_counter()

        async def attempt() -> list[RolloutState | Exception]:
            nonlocal t0
            t0 = time.perf_counter()  # the histogram times the round trip that was taken
            if not before:
                return await self.store.append_many(chains)
            return await self.store.append_many(chains, before=before)

        try:
            # Refused for a condition of Redis's own (out of memory, a failed disk write):
            # nothing was written, so the same chains go again until Redis takes them. The
            # callers wait, and their rollouts keep generating meanwhile: an episode is a slow
            # round trip, never a lost one, and no token is dropped or sent twice.
            results = await self.condition.until_written(attempt, "checkpoint")
        except Exception as exc:
            # Redis unreachable: every caller gets the error and may retry its chain as is,
            # which is safe because a repeated append is recognised and not applied twice.
            for _, _, future, _, _ in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.round_trips += 1
        if self.observe is not None:
            self.observe(time.perf_counter() - t0)
        for (_, _, future, _, _), result in zip(batch, results, strict=True):
            if future.done():
                continue  # its caller was cancelled meanwhile
            if isinstance(result, RolloutState):
                future.set_result(result)
            else:
                future.set_exception(result)
