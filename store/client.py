"""The trainer's client: submit rollouts, wait for their trajectories.

``RolloutClient`` is asyncio; ``SyncRolloutClient`` offers the same calls to a synchronous
trainer loop by running the async client on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from statemachine import TERMINAL, RolloutRequest, RolloutState, Status, commands
from store import defaults
from store.connection import connect, connect_sync
from store.errors import StoreError
from store.event_store import EventStore
from store.keys import Keys, check_rollout_id
from store.queue import enqueue_rollouts_async, rollout_queue
from store.results import RolloutResult, Tokenizer
from store.weights import WeightRegistry, WeightVersion

T = TypeVar("T")


class WaitTimeout(StoreError, TimeoutError):
    """``wait`` gave up before every rollout ended; the rollouts carry on regardless."""


class RolloutClient:
    def __init__(
        self,
        url: str,
        *,
        queue_name: str = defaults.QUEUE_NAME,
        keys: Keys | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.redis = connect(url)
        self.store = EventStore(self.redis, keys)
        self.weights = WeightRegistry(self.redis, keys)
        # rq is synchronous: it gets its own (sync) connection, used from a thread.
        self._queue = rollout_queue(connect_sync(url), queue_name)
        self.tokenizer = tokenizer

    async def submit(
        self, requests: Sequence[RolloutRequest], *, ids: Sequence[str] | None = None
    ) -> list[str]:
        """Record each request durably, then enqueue it. Returns the rollout ids.

        Passing ``ids`` makes a retried submit idempotent: an id already submitted with the
        same request is not submitted twice (a different request under it is refused)."""
        if ids is None:
            ids = [uuid.uuid4().hex for _ in requests]
        if len(ids) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(ids)} ids")
        for rid in ids:
            check_rollout_id(rid)
        now = time.time()
        latest = await self.weights.latest()
        admitted = latest.version if latest is not None else 0
        chains = [
            (
                None,
                [
                    commands.submit(
                        rid, req, admitted_version=admitted, queue=self._queue.name, at=now
                    )
                ],
            )
            for rid, req in zip(ids, requests, strict=True)
        ]
        for result in await self.store.append_many(chains):
            if not isinstance(result, RolloutState):
                raise result
        # Enqueued after the record exists, so a worker never sees a job without a rollout.
        await enqueue_rollouts_async(self._queue, ids)
        return list(ids)

    async def publish_weights(self, version: int, path: str) -> WeightVersion:
        """Record weight ``version`` (at checkpoint ``path``) and so notify every worker.
        Versions only go up: an older or equal one raises ``StaleWeightVersion``."""
        return await self.weights.publish(version, path)

    async def statuses(self, ids: Sequence[str]) -> list[str]:
        return [s.value for s in await self.store.statuses(ids)]

    async def result(self, rollout_id: str) -> RolloutResult:
        return RolloutResult.from_state(await self.store.load(rollout_id), self.tokenizer)

    async def wait(
        self, ids: Sequence[str], *, timeout: float | None = None
    ) -> list[RolloutResult]:
        """Block until every rollout is done, failed or cancelled; results in ``ids`` order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(dict.fromkeys(ids))
        delay, max_delay = defaults.WAIT_POLL_S
        while pending:
            statuses = await self.statuses(pending)
            pending = [
                rid for rid, s in zip(pending, statuses, strict=True) if Status(s) not in TERMINAL
            ]
            if not pending:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"{len(pending)} of {len(ids)} rollouts still running")
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 1.5)
        return [await self.result(rid) for rid in ids]

    async def aclose(self) -> None:
        await self.redis.aclose()
        self._queue.connection.close()


class SyncRolloutClient:
    """The same client for synchronous code: each call blocks until its result is ready."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: RolloutClient = self._call(_make(url, kwargs))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, requests: Sequence[RolloutRequest], **kw: Any) -> list[str]:
        return self._call(self._client.submit(requests, **kw))

    def wait(self, ids: Sequence[str], **kw: Any) -> list[RolloutResult]:
        return self._call(self._client.wait(ids, **kw))

    def result(self, rollout_id: str) -> RolloutResult:
        return self._call(self._client.result(rollout_id))

    def publish_weights(self, version: int, path: str) -> WeightVersion:
        return self._call(self._client.publish_weights(version, path))

    def close(self) -> None:
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


async def _make(url: str, kwargs: dict[str, Any]) -> RolloutClient:
    return RolloutClient(url, **kwargs)
