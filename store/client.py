"""The trainer's client: submit groups of rollouts, consume them as they finish, cancel,
acknowledge, publish weights, read stats (a training step: the README's "A training loop").

``RolloutClient`` is asyncio and is the one place these operations live (the HTTP API calls
it); ``SyncRolloutClient`` offers the same calls to a synchronous trainer loop by running the
async client on a private event-loop thread (``store.sync_client``, which imports this one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence

from statemachine import GroupPolicy, RolloutState, SamplingParams
from store import (
    batches,
    bulk,
    completions,
    defaults,
    lifecycle,
    queue_redis,
    sessions,
    submission,
    waiting,
)  # fmt: skip
from store.batches import BatchConflict, BatchInfo
from store.cluster_appends import ClusterUnsupported
from store.completions import UnknownPosition, WaitTimeout
from store.connection import connect, connect_store, connect_sync, connect_sync_store
from store.errors import GroupNotFound, RolloutNotFound, StoreUnwritable, named, named_stream
from store.event_store import EventStore
from store.keys import Keys
from store.lifecycle import AckReport, RolloutEnded
from store.queue import JobWriter, rollout_queue
from store.replicas import acked
from store.results import GroupResult, RolloutResult, Tokenizer
from store.sessions import SessionCall
from store.stats import Stats, read_stats
from store.submission import Batch, ChatTemplater, Prompt
from store.trajectory import Trajectory, load_trajectory
from store.weights import WeightRegistry, WeightVersion

__all__ = ["AckReport", "Batch", "BatchConflict", "RolloutClient", "RolloutEnded", "SessionCall",
           "StoreUnwritable", "Trajectory", "UnknownPosition",
           "WaitTimeout"]  # fmt: skip


# An indexed batch with no record younger than this may be a submit's under way (the index is
# written first on a cluster): not forgotten yet. A submit records it within a round trip.
INDEX_GRACE_S = 60.0


class RolloutClient:
    def __init__(
        self,
        url: str,
        *,
        queue_url: str | None = None,
        queue_name: str = defaults.QUEUE_NAME,
        keys: Keys | None = None,
        tokenizer: Tokenizer | None = None,
        retention_s: int = defaults.RETENTION_S,
        max_tokens_cap: int | None = defaults.MAX_TOKENS_CAP,
        min_replicas_acked: int = 0,
    ) -> None:
        """``url``: the store's Redis, or a Redis Cluster (``redis+cluster://host:port,...``),
        which needs ``queue_url``; ``queue_url``: rq's queue, when not on the store's Redis
        (``store.queue_redis``); ``min_replicas_acked``: a write counts as done once that many
        replicas have it (``store.replicas``; on a cluster, of every master), else it raises
        ``ReplicasNotAcked``; retry it as it was."""
        # A cluster store without a queue of its own is refused as the commands refuse it.
        queue_redis.resolve(url, queue_url, env={})
        self.redis = connect_store(url)
        self.min_replicas_acked = min_replicas_acked
        # keys None: the store picks them (a group's rollouts in one slot on a cluster).
        self.store = EventStore(self.redis, keys, replicas_acked=min_replicas_acked)
        self.keys = self.store.keys
        self.weights = WeightRegistry(self.redis, self.keys)
        # rq is synchronous: it gets its own (sync) connection to the queue's Redis, used from a
        # thread (and shared by an EnvironmentClient beside this client, for its rq job
        # templates: store.api). Apart, the submit's store reads and step get one of their
        # own (sync_store), and ack and stats reach the queue on an asyncio one (queue_redis).
        self.queue_apart = queue_redis.apart(url, queue_url)
        self.sync_redis = connect_sync(queue_url or url)
        self.sync_store = connect_sync_store(url) if self.queue_apart else self.sync_redis
        self.queue_redis = connect(queue_url or url) if self.queue_apart else self.redis
        self._queue = rollout_queue(self.sync_redis, queue_name)
        self._jobs: JobWriter | None = None
        self.tokenizer = tokenizer
        self.retention_s = int(retention_s)
        self.max_tokens_cap = max_tokens_cap

    # -- submit -------------------------------------------------------------------------------
    @named
    @acked
    async def submit(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        batch_id: str | None = None,
        ids: Sequence[str] | None = None,
        group_policy: GroupPolicy | str = GroupPolicy.SAMPLE,
        session: str | None = None,
    ) -> Batch:
        """Record ``n`` samples of each prompt and enqueue them; returns their ids.

        ``sampling`` (one, or one per prompt) replaces the prompts' own. ``batch_id`` is the
        idempotency key: a retried submit under it returns the same ids and enqueues nothing
        new; a different submission under it raises ``BatchConflict``. Named ``ids`` make a
        retry idempotent too. Everything checkable without the model is checked first; a
        refused submit writes nothing (see ``store.batches`` for how nothing is stranded).
        ``session``: the batch is a call of that session (``session``, ``store.sessions``)."""
        templater: ChatTemplater | None = self.tokenizer  # type: ignore[assignment]
        s = submission.build(
            prompts,
            n=n,
            sampling=sampling,
            batch_id=batch_id,
            ids=ids,
            group_policy=group_policy,
            queue=self._queue.name,
            admitted_version=0,  # the newest published when recorded (store.batches)
            at=time.time(),
            tokenizer=templater,
            max_tokens_cap=self.max_tokens_cap,
        )
        if session is not None:
            sessions.refuse_on_cluster(self.redis)  # before anything is written
        if self.store.cluster and any(r.episode is not None for r in s.requests):
            raise ClusterUnsupported("episodes (their tool calls' indexes span hash slots) "
                                     "are not offered on Redis Cluster yet")  # fmt: skip
        if self._jobs is None:  # rq's job template, made once (it asks Redis: in a thread)
            self._jobs = await asyncio.to_thread(JobWriter, self._queue)
        # Before the batch is recorded (store.sessions says why); checks the session id.
        noted, affinity = await sessions.begin(
            self.redis, self.keys, session, s.batch_id, self.retention_s
        )
        try:
            # Shielded: a cancelled caller leaves the record to finish, not half written.
            created = await asyncio.shield(batches.record_async(
                self.redis, self.sync_store, self._queue, self.store, s, ids is not None,
                self.retention_s, affinity, self._jobs, self.queue_apart))  # fmt: skip
        except BatchConflict:
            if noted:  # nothing of this submit was written: nor is its session's entry
                await sessions.unnote(self.redis, self.keys, session, s.batch_id)  # type: ignore[arg-type]
            raise
        return Batch(s, fresh=created)

    # -- batches ------------------------------------------------------------------------------
    async def batch(self, batch_id: str) -> BatchInfo:
        found = await batches.info_async(self.redis, self.keys, batch_id)
        if found is None:
            raise RolloutNotFound(f"batch {batch_id}")
        return found

    @named
    async def batches(self) -> list[str]:
        """Every batch still recorded, oldest first: what a restarted trainer re-attaches to."""
        entries = await self.redis.zrange(self.keys.batches(), 0, -1, withscores=True)
        if not entries:
            return []
        ids = [b for b, _ in entries]
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in ids:
                pipe.exists(self.keys.batch(b.decode()))
            alive = await pipe.execute()
        # Expired or fully acknowledged: forgotten. On a cluster a submit indexes its batch
        # before it records it (store.submit_cluster): one indexed a moment ago is left be.
        young = time.time() - INDEX_GRACE_S
        gone = [b for (b, at), a in zip(entries, alive, strict=True) if not a and at < young]
        if gone:
            await self.redis.zrem(self.keys.batches(), *gone)
        return [b.decode() for b, a in zip(ids, alive, strict=True) if a]

    @named
    async def session(self, session_id: str) -> list[SessionCall]:
        """A session's calls in the order they were made, with their rollouts' states; calls
        acknowledged or expired are left out (an unknown session has none)."""
        return await sessions.listing(self.redis, self.keys, session_id)

    @named
    async def trajectory(self, session_id: str) -> Trajectory:
        """A session's calls as one trajectory with its loss mask (``store.trajectory``)."""
        return await load_trajectory(self.redis, self.keys, session_id, self._results)

    # -- results ------------------------------------------------------------------------------
    @named_stream
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
        ``position`` (one that is no position of the batch raises ``UnknownPosition``);
        rollouts acknowledged before they were delivered are skipped.
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
        await completions.check_position(self.redis, self.keys, batch_id, after)
        wanted = set(info.ids) - await completions.delivered_before(
            self.redis, self.keys, batch_id, after
        )
        wanted -= set(await self._gone(sorted(wanted)))
        async for block in completions.follow(
            self.redis, self.keys, batch_id, wanted, after=after, timeout=timeout, gone=self._gone
        ):
            ids = [c.rollout_id for c in block]
            # An ack may land between the block's XREAD and this read: those rollouts are
            # skipped, as the ones acknowledged before the read are.
            for result in await self._results(ids, [c.position for c in block], skip_gone=True):
                yield result

    @named_stream
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
                # RolloutNotFound: the batch was acknowledged whole meanwhile, which only
                # happens once every rollout of it ended: nothing is left to cancel.
                with contextlib.suppress(RolloutNotFound):
                    await self.cancel(batch_id=batch_id, reason=f"take={take} reached")
                return
        # Groups some of whose samples were acknowledged or expired before delivery.
        for g in sorted(pending):
            yield GroupResult(batch_id, g, _ordered(pending[g]), info.group_size)

    @named
    async def wait(
        self, ids: Sequence[str], *, timeout: float | None = None
    ) -> list[RolloutResult]:
        """Block until every rollout of ``ids`` ended; results in ``ids`` order. A thin layer
        over the completion streams: rollouts that ended already are read at once. A batch
        this client's ``submit`` just created (``Batch.fresh``) is followed from its stream's
        start, without reading its rollouts' heads first."""
        order = list(dict.fromkeys(ids))
        by_batch = await waiting.by_batch(self.store, ids, order)
        deadline = None if timeout is None else time.monotonic() + timeout
        for batch_id, running in by_batch.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            async for _ in completions.follow(
                self.redis, self.keys, batch_id, running, timeout=left, gone=self._gone
            ):
                pass
        found = dict(zip(order, await self._results(order), strict=True))
        return [found[rid] for rid in ids]

    @named
    async def result(self, rollout_id: str) -> RolloutResult:
        return RolloutResult.from_state(await self.store.load(rollout_id), self.tokenizer)

    async def statuses(self, ids: Sequence[str]) -> list[str]:
        return [s.value for s in await self.store.statuses(ids)]

    # -- cancel and acknowledge ---------------------------------------------------------------
    @named
    async def cancel(
        self,
        ids: Sequence[str] | None = None,
        *,
        batch_id: str | None = None,
        group: int | None = None,
        session: str | None = None,
        reason: str = "cancelled by the trainer",
    ) -> list[str]:
        """Cancel rollouts: ``ids``, a whole batch, one group of it (``batch_id`` and
        ``group``), or every call of a ``session``. Returns the ids cancelled. Naming an ended
        rollout in ``ids`` raises ``RolloutEnded`` and cancels nothing; the others skip ended
        ones."""
        if session is not None:
            sessions.alone(ids, batch_id, group)
            targets = await sessions.rollouts(self.redis, self.keys, session)
            return await lifecycle.cancel(self.store, targets, reason, refuse_ended=False)
        targets = await self._targets(ids, batch_id, group)
        return await lifecycle.cancel(self.store, targets, reason, refuse_ended=ids is not None)

    @named
    @acked
    async def ack(
        self,
        ids: Sequence[str] | None = None,
        *,
        batch_id: str | None = None,
        group: int | None = None,
        session: str | None = None,
    ) -> AckReport:
        """Delete ended rollouts (log, snapshot, completion entry, rq job). Live ones are
        never deleted: the report lists them. Acknowledging a whole batch whose rollouts are
        all gone also deletes the batch's record and stream; a ``session``: each of its calls'
        batches so, and the session's index once nothing of it is live."""
        if session is not None:
            sessions.alone(ids, batch_id, group)
            return await sessions.ack(self.redis, self.keys, session, self.ack, self.store)
        targets = await self._targets(ids, batch_id, group)
        owners = await self._batches_of(targets, batch_id)
        report = await lifecycle.ack(
            self.store, targets, owners, queue=self.queue_redis if self.queue_apart else None
        )
        if batch_id is not None and group is None and not report.live:
            # UNLINK: a stream whose entries outlived their rollouts (expired) is freed in
            # the background, not while Redis serves no one else. (One slot: the batch's; on
            # a cluster, with the record of delivered completions, ``store.outbox``.)
            await self.redis.unlink(self.keys.batch(batch_id), self.keys.completions(batch_id),
                                    self.keys.completion_ids(batch_id))  # fmt: skip
            await self.redis.zrem(self.keys.batches(), batch_id)
        return report

    # -- weights and stats --------------------------------------------------------------------
    @named
    @acked
    async def publish_weights(self, version: int, path: str) -> WeightVersion:
        """Record weight ``version`` (at checkpoint ``path``) and so notify every worker.
        Versions only go up: an older or equal one raises ``StaleWeightVersion``."""
        return await self.weights.publish(version, path)

    async def stats(self) -> Stats:
        """Rollouts by state, tokens, queue depths and live workers, in one round trip."""
        return await read_stats(self.redis, self.keys, self.queue_redis if self.queue_apart
                                else None)  # fmt: skip

    async def aclose(self) -> None:
        await self.redis.aclose()
        self._queue.connection.close()
        if self.queue_apart:
            await self.queue_redis.aclose()
            self.sync_store.close()

    # -- helpers ------------------------------------------------------------------------------
    async def _results(
        self,
        ids: Sequence[str],
        positions: Sequence[str] | None = None,
        *,
        skip_gone: bool = False,
    ) -> list[RolloutResult]:
        """The results of ``ids``; ``skip_gone``: leave out the rollouts that no longer exist
        (acknowledged or expired) instead of raising ``RolloutNotFound``. Loaded
        ``LOAD_CHUNK`` at a time: each load is a transaction that reads whole logs."""
        states: list[RolloutState | Exception] = []
        for part in bulk.chunks(ids, defaults.LOAD_CHUNK):
            states += await self.store.load_many(part)
        out = []
        for i, (rid, s) in enumerate(zip(ids, states, strict=True)):
            pos = positions[i] if positions is not None else ""
            if isinstance(s, RolloutState):
                out.append(RolloutResult.from_state(s, self.tokenizer, pos))
            elif isinstance(s, RolloutNotFound):
                if not skip_gone:
                    raise s
            else:
                out.append(RolloutResult.unreadable(rid, str(s), pos))
        return out

    async def _gone(self, ids: Sequence[str]) -> list[str]:
        gone: list[str] = []
        for part in bulk.chunks(ids):  # a bounded pipeline per round trip
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid in part:
                    pipe.exists(self.keys.snapshot(rid))
                found = await pipe.execute()
            gone += [rid for rid, f in zip(part, found, strict=True) if not f]
        return gone

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
            raise GroupNotFound(info.batch_id, info.groups, group)
        return info.group_ids(group)

    async def _batches_of(self, ids: Sequence[str], batch_id: str | None) -> list[str]:
        if batch_id is not None:
            return [batch_id] * len(ids)
        heads = await lifecycle.heads(self.store, ids)
        return [h.membership.batch_id if isinstance(h, RolloutState) else "" for h in heads]


def _ordered(members: dict[int, RolloutResult]) -> list[RolloutResult]:
    return [members[i] for i in sorted(members)]
