"""``SyncRolloutClient``: the trainer's client for synchronous code, the asyncio
``store.client.RolloutClient`` run on a private event-loop thread (``store.client`` exports
both)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from store.client import RolloutClient
from store.lifecycle import AckReport
from store.results import GroupResult, RolloutResult
from store.sessions import SessionCall
from store.stats import Stats
from store.submission import Batch, Prompt
from store.trajectory import Trajectory
from store.weights import WeightVersion

T = TypeVar("T")


class SyncRolloutClient:
    """The same client for synchronous code: each call blocks until its result is ready;
    the streaming calls (``results``, ``groups``) are plain iterators."""

    def __init__(self, url: str, *, queue_url: str | None = None, **kwargs: Any) -> None:
        """``RolloutClient``'s arguments (``queue_url``: rq's queue, when not the store's)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: RolloutClient = self._call(_make(url, queue_url, kwargs))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self._call(agen.__anext__())  # type: ignore[arg-type]
            except StopAsyncIteration:
                return

    def submit(self, prompts: Sequence[Prompt], **kw: Any) -> Batch:
        return self._call(self._client.submit(prompts, **kw))

    def results(self, batch_id: str, **kw: Any) -> Iterator[RolloutResult]:
        return self._iterate(self._client.results(batch_id, **kw))

    def groups(self, batch_id: str, **kw: Any) -> Iterator[GroupResult]:
        return self._iterate(self._client.groups(batch_id, **kw))

    def wait(self, ids: Sequence[str], **kw: Any) -> list[RolloutResult]:
        return self._call(self._client.wait(ids, **kw))

    def result(self, rollout_id: str) -> RolloutResult:
        return self._call(self._client.result(rollout_id))

    def cancel(self, ids: Sequence[str] | None = None, **kw: Any) -> list[str]:
        return self._call(self._client.cancel(ids, **kw))

    def ack(self, ids: Sequence[str] | None = None, **kw: Any) -> AckReport:
        return self._call(self._client.ack(ids, **kw))

    def batches(self) -> list[str]:
        return self._call(self._client.batches())

    def session(self, session_id: str) -> list[SessionCall]:
        return self._call(self._client.session(session_id))

    def trajectory(self, session_id: str) -> Trajectory:
        return self._call(self._client.trajectory(session_id))

    def stats(self) -> Stats:
        return self._call(self._client.stats())

    def publish_weights(self, version: int, path: str) -> WeightVersion:
        return self._call(self._client.publish_weights(version, path))

    def close(self) -> None:
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


async def _make(url: str, queue_url: str | None, kwargs: dict[str, Any]) -> RolloutClient:
    # Made on the private loop: the client's asyncio connections belong to it.
    return RolloutClient(url, queue_url=queue_url, **kwargs)
