"""A rollout's place on the engine, and the worker's N of them.

The runner enters a place before its request goes to the engine and frees it when the rollout
no longer needs the engine (``EnginePlace``); the worker hands them out (``JobSlot``) from its
``EnginePlaces``, so that up to N rollouts are on the engine while up to N more are begun.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol


class EnginePlace(Protocol):
    """A rollout's place on the engine, as the worker hands them out (``RolloutRunner.run``)."""

    async def enter(self) -> None:
        """Until the engine has room for one more of the worker's requests."""

    def nearly_free(self) -> None:
        """The rollout has at most ``prefetch_tokens`` left: the worker may take its next job."""

    def free(self) -> None:
        """The rollout no longer needs the engine. Called at most once."""


class EnginePlaces:
    """The engine's N places for this worker's requests, and how long freed ones stood empty
    before the next rollout took them (``refill_s`` over ``refills``: bench_vllm reports it).
    Freed places are matched to takers first in, first out; ``forget`` drops those freed
    before a quiet spell (the end of a batch), which no rollout was waiting to refill."""

    def __init__(self, n: int) -> None:
        self._free = asyncio.Semaphore(n)
        self._freed_at: deque[float] = deque()
        self.refills = 0
        self.refill_s = 0.0

    async def acquire(self) -> None:
        await self._free.acquire()
        if self._freed_at:
            self.refills += 1
            self.refill_s += time.monotonic() - self._freed_at.popleft()

    def release(self) -> None:
        self._freed_at.append(time.monotonic())
        self._free.release()

    def forget(self) -> None:
        self._freed_at.clear()


class JobSlot:
    """A taken job's two places, each released once, whoever releases first: one of the take
    loop's N slots (``slots``), given back when its rollout is nearly done (``nearly_free``)
    so that the next job is dequeued, loaded, leased and begun meanwhile; and, from ``enter``
    on, one of the engine's N places (``places``), given back when it no longer needs the
    engine. So up to N rollouts are on the engine and up to N more are being begun."""

    def __init__(self, slots: asyncio.Semaphore, places: EnginePlaces) -> None:
        self._slots: asyncio.Semaphore | None = slots
        self._places = places
        self._entered = False

    async def enter(self) -> None:
        await self._places.acquire()
        self._entered = True

    def nearly_free(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None

    def free(self) -> None:
        self.nearly_free()
        if self._entered:
            self._entered = False
            self._places.release()
