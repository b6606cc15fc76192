"""Concurrent single calls served by one batched call (a group commit for small requests).

A worker at GPU cadence starts and ends hundreds of rollouts at once: one load, one lease taken
and one dropped per rollout, each its own round trip, made the asyncio client open one Redis
connection per rollout in flight and cost more CPU than the batch they could share (measured:
``bench/bench_overhead.py``'s gpu_cadence). ``Coalescer`` keeps the single-call interface for
its callers and runs what they ask for together: the calls made while a batch is in flight,
or in the same turn of the event loop, go in the next one. One batch is in flight at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

# The batched call: one result per key, in order; an exception in a key's place is raised
# to that key's caller only (one bad rollout spoils only itself).
Many = Callable[[list[K]], Awaitable[Sequence[V | BaseException]]]


class Coalescer(Generic[K, V]):
    def __init__(self, many: Many[K, V], *, limit: int = 512) -> None:
        self._many = many
        self._limit = limit  # keys per batch at most: bounds one round trip's size
        self._waiting: list[tuple[K, asyncio.Future[V]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def __call__(self, key: K) -> V:
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._waiting.append((key, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="coalescer")
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # the callers of this turn of the loop join the first batch
        while self._waiting:
            batch, self._waiting = self._waiting[: self._limit], self._waiting[self._limit :]
            try:
                results = await self._many([key for key, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{len(results)} results for {len(batch)} calls")
            except asyncio.CancelledError:
                for _, future in batch + self._waiting:
                    future.cancel()
                self._waiting = []
                raise
            except Exception as exc:
                # The whole batch failed (Redis gone past the client's retries): every caller
                # gets the error, as its own call would have; each decides on its retry.
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # its caller was cancelled meanwhile
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
