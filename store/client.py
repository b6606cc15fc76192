"""The trainer's client: submit groups of rollouts, consume them as they finish, cancel,
acknowledge, publish weights, read stats.

``RolloutClient`` is asyncio and is the one place these operations live (the HTTP API calls
it); ``SyncRolloutClient`` offers the same calls to a synchronous trainer loop by running the
async client on a private event-loop thread.

A training step::

    batch = await client.submit(prompts, n=4, batch_id=f"step-{step}")
    async for group in client.groups(batch.batch_id):
        train_on(group.results)
        await client.ack(group.rollout_ids)
    await client.publish_weights(step + 1, checkpoint_path)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from statemachine import GroupPolicy, RolloutState, SamplingParams
from store import batches, completions, defaults, lifecycle, submission
from store.batches import BatchConflict, BatchInfo
from store.completions import WaitTimeout
from store.connection import connect, connect_sync
from store.errors import RolloutNotFound
from store.event_store import EventStore
from store.keys import Keys
from store.lifecycle import AckReport, RolloutEnded
from store.queue import rollout_queue
from store.results import GroupResult, RolloutResult, Tokenizer
from store.stats import Stats, read_stats
from store.submission import ChatTemplater, Prompt, Submission
from store.weights import WeightRegistry, WeightVersion

T = TypeVar("T")

__all__ = [
    "AckReport",
    "Batch",
    "BatchConflict",
    "RolloutClient",
    "RolloutEnded",
    "SyncRolloutClient",
    "WaitTimeout",
]


class Batch(list[str]):
    """The rollout ids of one submit (group-major: the samples of prompt 0, then of prompt
    1, ...), with the batch they belong to."""

    def __init__(self, s: Submission) -> None:
        super().__init__(s.ids)
        self.batch_id = s.batch_id
        self.group_size = s.group_size

    def groups(self) -> list[list[str]]:
        n = self.group_size
        return [self[i : i + n] for i in range(0, len(self), n)]


class RolloutClient:
    def __init__(
        self,
        url: str,
        *,
        queue_name: str = defaults.QUEUE_NAME,
        keys: Keys | None = None,
        tokenizer: Tokenizer | None = None,
        retention_s: int = defaults.RETENTION_S,
        max_tokens_cap: int | None = defaults.MAX_TOKENS_CAP,
    ) -> None:
        self.redis = connect(url)
        self.store = EventStore(self.redis, keys)
        self.keys = self.store.keys
        self.weights = WeightRegistry(self.redis, keys)
        # rq is synchronous: it gets its own (sync) connection, used from a thread.
        self._queue = rollout_queue(connect_sync(url), queue_name)
        self.tokenizer = tokenizer
        self.retention_s = int(retention_s)
        self.max_tokens_cap = max_tokens_cap

    # -- submit -------------------------------------------------------------------------------
    async def submit(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        batch_id: str | None = None,
        ids: Sequence[str] | None = None,
        group_policy: GroupPolicy | str = GroupPolicy.SAMPLE,
    ) -> Batch:
        """Record ``n`` samples of each prompt and enqueue them; returns their ids.

        ``sampling`` (one, or one per prompt) replaces the prompts' own. ``batch_id`` is the
        idempotency key: a retried submit under it returns the same ids and enqueues nothing
        new; a different submission under it raises ``BatchConflict``. Named ``ids`` make a
        retry idempotent too. Everything checkable without the model is checked first; a
        refused submit writes nothing (see ``store.batches`` for how nothing is stranded)."""
        latest = await self.weights.latest()
        templater: ChatTemplater | None = self.tokenizer  # type: ignore[assignment]
        s = submission.build(
            prompts,
            n=n,
            sampling=sampling,
            batch_id=batch_id,
            ids=ids,
            group_policy=group_policy,
            queue=self._queue.name,
            admitted_version=latest.version if latest is not None else 0,
            at=time.time(),
            tokenizer=templater,
            max_tokens_cap=self.max_tokens_cap,
        )
        await asyncio.to_thread(
            batches.record,
            self._queue.connection,
            self._queue,
            self.store,
            s,
            named_ids=ids is not None,
            retention_s=self.retention_s,
        )
        return Batch(s)

    # -- batches ------------------------------------------------------------------------------
    async def batch(self, batch_id: str) -> BatchInfo:
        found = await batches.info_async(self.redis, self.keys, batch_id)
        if found is None:
            raise RolloutNotFound(f"batch {batch_id}")
        return found

    async def batches(self) -> list[str]:
        """Every batch still recorded, oldest first: what a restarted trainer re-attaches to."""
        ids = await self.redis.zrange(self.keys.batches(), 0, -1)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in ids:
                pipe.exists(self.keys.batch(b.decode()))
            alive = await pipe.execute()
        gone = [b for b, a in zip(ids, alive, strict=True) if not a]
        if gone:  # expired or fully acknowledged: forget them
            await self.redis.zrem(self.keys.batches(), *gone)
        return [b.decode() for b, a in zip(ids, alive, strict=True) if a]

    # -- results ------------------------------------------------------------------------------
    async def results(
        self,
        batch_id: str,
        *,
        after: str = completions.START,
        take: int | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RolloutResult]:
        """Each rollout of the batch as it ends (done, failed or cancelled), in the order
        they ended, until all have been delivered. ``after`` resumes after a result's
        ``position``; rollouts acknowledged before they were delivered are skipped.
        ``take=k``: the rollouts of the first ``k`` groups to finish, a group at a time, and
        the rest of the batch is cancelled (see ``groups``)."""
        if take is not None:
            if after != completions.START:
                raise ValueError("take counts groups from the start of the batch: no after")
            async for group in self.groups(batch_id, take=take, timeout=timeout):
                for r in group.results:
                    yield r
            return
        info = await self.batch(batch_id)
        wanted = set(info.ids) - await completions.delivered_before(
            self.redis, self.keys, batch_id, after
        )
        wanted -= set(await self._gone(sorted(wanted)))
        async for block in completions.follow(
            self.redis, self.keys, batch_id, wanted, after=after, timeout=timeout, gone=self._gone
        ):
            ids = [c.rollout_id for c in block]
            for result in await self._results(ids, [c.position for c in block]):
                yield result

    async def groups(
        self,
        batch_id: str,
        *,
        take: int | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[GroupResult]:
        """Whole groups (every sample of a prompt) as their last sample ends. ``take=k``:
        the first ``k`` groups to finish, then the rest of the batch is cancelled (over-
        sampling: the long tail is not waited for)."""
        info = await self.batch(batch_id)
        pending: dict[int, dict[int, RolloutResult]] = defaultdict(dict)
        yielded = 0
        if take is not None and take < 1:
            raise ValueError(f"take must be >= 1, got {take}")
        async for r in self.results(batch_id, timeout=timeout):
            members = pending[r.group_index]
            members[r.sample_index] = r
            if len(members) < info.group_size:
                continue
            del pending[r.group_index]
            yield GroupResult(batch_id, r.group_index, _ordered(members), info.group_size)
            yielded += 1
            if take is not None and yielded >= take:
                await self.cancel(batch_id=batch_id, reason=f"take={take} reached")
                return
        # Groups some of whose samples were acknowledged or expired before delivery.
        for g in sorted(pending):
            yield GroupResult(batch_id, g, _ordered(pending[g]), info.group_size)

    async def wait(
        self, ids: Sequence[str], *, timeout: float | None = None
    ) -> list[RolloutResult]:
        """Block until every rollout of ``ids`` ended; results in ``ids`` order. A thin layer
        over the completion streams: rollouts that ended already are read at once."""
        order = list(dict.fromkeys(ids))
        heads = await lifecycle.heads(self.store, order)
        by_batch: dict[str, list[str]] = defaultdict(list)
        for rid, h in zip(order, heads, strict=True):
            if isinstance(h, RolloutNotFound):
                raise h
            if isinstance(h, RolloutState) and not h.terminal:
                by_batch[h.membership.batch_id].append(rid)
        deadline = None if timeout is None else time.monotonic() + timeout
        for batch_id, waiting in by_batch.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            async for _ in completions.follow(
                self.redis, self.keys, batch_id, waiting, timeout=left, gone=self._gone
            ):
                pass
        found = dict(zip(order, await self._results(order), strict=True))
        return [found[rid] for rid in ids]

    async def result(self, rollout_id: str) -> RolloutResult:
        return RolloutResult.from_state(await self.store.load(rollout_id), self.tokenizer)

    async def statuses(self, ids: Sequence[str]) -> list[str]:
        return [s.value for s in await self.store.statuses(ids)]

    # -- cancel and acknowledge ---------------------------------------------------------------
    async def cancel(
        self,
        ids: Sequence[str] | None = None,
        *,
        batch_id: str | None = None,
        group: int | None = None,
        reason: str = "cancelled by the trainer",
    ) -> list[str]:
        """Cancel rollouts: ``ids``, a whole batch, or one group of it (``batch_id`` and
        ``group``). Returns the ids cancelled. Naming an ended rollout in ``ids`` raises
        ``RolloutEnded`` and cancels nothing; a batch or group cancel skips ended ones."""
        targets = await self._targets(ids, batch_id, group)
        return await lifecycle.cancel(self.store, targets, reason, refuse_ended=ids is not None)

    async def ack(
        self,
        ids: Sequence[str] | None = None,
        *,
        batch_id: str | None = None,
        group: int | None = None,
    ) -> AckReport:
        """Delete ended rollouts (log, snapshot, completion entry, rq job). Live ones are
        never deleted: the report lists them. Acknowledging a whole batch whose rollouts are
        all gone also deletes the batch's record and stream."""
        targets = await self._targets(ids, batch_id, group)
        owners = await self._batches_of(targets, batch_id)
        report = await lifecycle.ack(self.store, targets, owners)
        if batch_id is not None and group is None and not report.live:
            await self.redis.delete(self.keys.batch(batch_id), self.keys.completions(batch_id))
            await self.redis.zrem(self.keys.batches(), batch_id)
        return report

    # -- weights and stats --------------------------------------------------------------------
    async def publish_weights(self, version: int, path: str) -> WeightVersion:
        """Record weight ``version`` (at checkpoint ``path``) and so notify every worker.
        Versions only go up: an older or equal one raises ``StaleWeightVersion``."""
        return await self.weights.publish(version, path)

    async def stats(self) -> Stats:
        """Rollouts by state, tokens, queue depths and live workers, in one round trip."""
        return await read_stats(self.redis, self.keys)

    async def aclose(self) -> None:
        await self.redis.aclose()
        self._queue.connection.close()

    # -- helpers ------------------------------------------------------------------------------
    async def _results(
        self, ids: Sequence[str], positions: Sequence[str] | None = None
    ) -> list[RolloutResult]:
        states = await self.store.load_many(ids)
        out = []
        for i, (rid, s) in enumerate(zip(ids, states, strict=True)):
            pos = positions[i] if positions is not None else ""
            if isinstance(s, RolloutState):
                out.append(RolloutResult.from_state(s, self.tokenizer, pos))
            elif isinstance(s, RolloutNotFound):
                raise s
            else:
                out.append(RolloutResult.unreadable(rid, str(s), pos))
        return out

    async def _gone(self, ids: Sequence[str]) -> list[str]:
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.exists(self.keys.snapshot(rid))
            found = await pipe.execute()
        return [rid for rid, f in zip(ids, found, strict=True) if not f]

    async def _targets(
        self, ids: Sequence[str] | None, batch_id: str | None, group: int | None
    ) -> list[str]:
        if (ids is None) == (batch_id is None):
            raise ValueError("name either ids or a batch_id (with a group, for one group)")
        if ids is not None:
            if group is not None:
                raise ValueError("group needs batch_id, not ids")
            return list(dict.fromkeys(ids))
        info = await self.batch(batch_id)  # type: ignore[arg-type]
        if group is None:
            return info.ids
        if not 0 <= group < info.groups:
            raise ValueError(f"batch {batch_id!r} has groups 0..{info.groups - 1}, not {group}")
        return info.group_ids(group)

    async def _batches_of(self, ids: Sequence[str], batch_id: str | None) -> list[str]:
        if batch_id is not None:
            return [batch_id] * len(ids)
        heads = await lifecycle.heads(self.store, ids)
        return [h.membership.batch_id if isinstance(h, RolloutState) else "" for h in heads]


def _ordered(members: dict[int, RolloutResult]) -> list[RolloutResult]:
    return [members[i] for i in sorted(members)]


class SyncRolloutClient:
    """The same client for synchronous code: each call blocks until its result is ready;
    the streaming calls (``results``, ``groups``) are plain iterators."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: RolloutClient = self._call(_make(url, kwargs))

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

    def stats(self) -> Stats:
        return self._call(self._client.stats())

    def publish_weights(self, version: int, path: str) -> WeightVersion:
        return self._call(self._client.publish_weights(version, path))

    def close(self) -> None:
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


async def _make(url: str, kwargs: dict[str, Any]) -> RolloutClient:
    return RolloutClient(url, **kwargs)
