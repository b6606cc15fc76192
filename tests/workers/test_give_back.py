"""Every path that gives a job back to rq keeps the job somewhere a later pass finds it until it
is safely queued (issue 28, point 3), on a real redis-server.

A failed enqueue is injected as the issue reproduced it: the rq queue's key made a string, so
that every push onto it fails (WRONGTYPE) for a while, as an enqueue refused under Redis OOM
fails; then the key is repaired and the job must be back on the queue (and, where a worker is
involved, the rollout finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job

from statemachine import Aborted, AbortReason, Status
from store import defaults
from store.client import RolloutClient
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.workers.helpers import out_of_memory, until
from workers.engines.synthetic import SyntheticEngine
from workers.rq_bridge import RqBridge, TakenJob
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


@pytest_asyncio.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


def _damage(sync: Redis, key: str) -> None:
    """Every push onto the list ``key`` fails (WRONGTYPE) until ``sync.delete(key)``."""
    sync.set(key, "not a list")


def _queued(sync: Redis, key: str) -> list[str]:
    return [j.decode() for j in sync.lrange(key, 0, -1)]


async def _sweep(bridge: RqBridge) -> list[str]:
    """One sweep, whether it reports a failure by raising (it did) or by logging it."""
    with contextlib.suppress(Exception):
        return await bridge.requeue_abandoned()
    return []


async def test_an_abandoned_job_whose_requeue_failed_is_requeued_by_a_later_sweep(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    # Before: rq's cleanup moved the lapsed execution's job to the failed registry, then rq's
    # requeue took it out of there and failed to push it: in no registry and on no queue, and
    # no later sweep looked (only lapsed executions are swept), so its rollout waited forever.
    [rid] = await client.submit([f.request(4)])
    [taken] = await bridge.dequeue_many(1, 1)
    queue, job_id = taken.queue, taken.job.id
    member = taken.execution.composite_key
    # Its worker died: the execution's heartbeat lapsed a minute ago.
    sync.zadd(queue.started_job_registry.key, {member: time.time() - 60})
    _damage(sync, queue.key)
    assert await _sweep(bridge) == []
    assert sync.zscore(queue.started_job_registry.key, member) is not None  # still there
    sync.delete(queue.key)
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)  # its backoff
    assert await _sweep(bridge) == [job_id]
    assert _queued(sync, queue.key) == [job_id]
    assert sync.zscore(queue.started_job_registry.key, member) is None
    assert sync.hget(Job.key_for(job_id), "status") == b"queued"
    assert queue.failed_job_registry.get_job_ids() == []
    # rq reads it back as a queued job of that rollout, as it reads one it requeued itself.
    job = Job.fetch(job_id, connection=sync, serializer=queue.serializer)
    assert job.kwargs == {"rollout_id": rid} and job.started_at is None
    assert await _sweep(bridge) == []  # once


async def test_a_job_rqs_own_cleanup_failed_as_abandoned_is_requeued_and_others_are_not(
    server: RedisServer, sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    # Before: `rq info` (which the README suggests) runs rq's cleanup of the started registry,
    # which moved the lapsed execution's job to the failed registry first; the sweep only
    # looked at lapsed executions, so nothing ever ran its rollout again.
    await client.submit([f.request(4) for _ in range(2)])
    abandoned, refused = await bridge.dequeue_many(1, 2)
    await bridge.fail(refused, "a failure of its own")  # never requeued
    queue = abandoned.queue
    sync.zadd(queue.started_job_registry.key,
              {abandoned.execution.composite_key: time.time() - 60})  # fmt: skip
    assert queue.started_job_registry.count == 0  # rq's cleanup, as `rq info` runs it
    assert sorted(queue.failed_job_registry.get_job_ids()) == sorted(
        [abandoned.job.id, refused.job.id]
    )
    assert await _sweep(bridge) == [abandoned.job.id]
    assert _queued(sync, queue.key) == [abandoned.job.id]
    assert queue.failed_job_registry.get_job_ids() == [refused.job.id]
    assert sync.hget(abandoned.job.key, "status") == b"queued"
    assert await _sweep(bridge) == []
    # And a worker runs it, from the failed registry's job as rq left it.
    worker = Worker(WorkerConfig(redis_url=server.url, name="w", burst=True), SyntheticEngine())
    await asyncio.wait_for(worker.run(), 60)
    [result] = await client.wait([abandoned.rollout_id], timeout=10)
    assert result.status is Status.DONE and len(result.response_token_ids) == 4


async def test_a_stuck_dequeue_whose_requeue_failed_is_requeued_by_a_later_sweep(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    # Before: the sweep took the job out of rq's intermediate list (LREM), then its push onto
    # the queue failed: the job was nowhere, and its rollout waited forever.
    await client.submit([f.request(4)])
    queue = bridge.queues[0]
    [job_id] = _queued(sync, queue.key)
    sync.lmove(queue.key, queue.intermediate_queue_key)  # popped by a worker that then died
    inter = IntermediateQueue(queue.key, connection=sync)
    sync.set(inter.get_first_seen_key(job_id), time.time() - 3600)  # seen stuck an hour ago
    _damage(sync, queue.key)
    assert await _sweep(bridge) == []
    assert _queued(sync, queue.intermediate_queue_key) == [job_id]  # still there
    sync.delete(queue.key)
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)
    assert await _sweep(bridge) == [job_id]
    assert _queued(sync, queue.key) == [job_id]
    assert _queued(sync, queue.intermediate_queue_key) == []
    assert not sync.exists(inter.get_first_seen_key(job_id))  # not left for rq's 24 h


async def test_a_sweep_that_read_the_list_before_a_start_leaves_no_mark(
    sync: Redis, bridge: RqBridge, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a sweep read the intermediate list and the started registry, a worker then
    # started the job (its start deletes any mark), and the sweep's SET NX marked it after:
    # a mark of a started job, kept 24 h (a 30-minute soak ended with 61 of them in Redis).
    # The sweep's reads are made to come before the start, as they did there.
    await client.submit([f.request(4) for _ in range(2)])
    [started] = await bridge.dequeue_many(1, 1)
    queue = started.queue
    sync.lmove(queue.key, queue.intermediate_queue_key)  # the other: popped, never started
    [stuck] = [j.decode() for j in sync.lrange(queue.intermediate_queue_key, 0, -1)]
    stale = [started.job.id, stuck]
    monkeypatch.setattr(IntermediateQueue, "get_job_ids", lambda self: list(stale))
    monkeypatch.setattr(type(queue.started_job_registry), "get_job_ids",
                        lambda self, *a, **kw: [])  # fmt: skip
    assert await _sweep(bridge) == []  # nothing stuck for an execution TTL yet
    inter = IntermediateQueue(queue.key, connection=sync)
    assert not sync.exists(inter.get_first_seen_key(started.job.id))
    assert sync.exists(inter.get_first_seen_key(stuck))  # still in the list: marked
    # A job deleted while it waited there (its rollout acknowledged) takes its mark along.
    sync.delete(Job.key_for(stuck))
    stale.remove(started.job.id)
    assert await _sweep(bridge) == []
    assert not sync.exists(inter.get_first_seen_key(stuck))
    assert not sync.keys("*first_seen*")


async def test_one_queue_that_cannot_be_swept_does_not_stop_the_others(
    server: RedisServer, sync: Redis
) -> None:
    # Before: the first failure ended the whole sweep, for every queue after it.
    bridge = RqBridge(server.url, ["qa", "qb"], "w2")
    await bridge.register()
    try:
        for name in ("qa", "qb"):
            on = RolloutClient(server.url, queue_name=name)
            await on.submit([f.request(4)])
            await on.aclose()
        taken = await bridge.dequeue_many(1, 2)
        assert sorted(t.queue.name for t in taken) == ["qa", "qb"]
        for t in taken:
            registry = t.queue.started_job_registry.key
            sync.zadd(registry, {t.execution.composite_key: time.time() - 60})
        by_queue = {t.queue.name: t for t in taken}
        _damage(sync, by_queue["qa"].queue.key)
        assert await _sweep(bridge) == [by_queue["qb"].job.id]
        assert _queued(sync, by_queue["qb"].queue.key) == [by_queue["qb"].job.id]
    finally:
        await bridge.close()


async def test_a_sweep_leaves_an_ended_jobs_leftover_entry_and_a_live_execution_alone(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    await client.submit([f.request(4) for _ in range(2)])
    ended, live = await bridge.dequeue_many(1, 2)
    registry = ended.queue.started_job_registry.key
    # An ended job whose entry was left behind (rq's own cleanup skips those too), and a
    # live execution (heartbeat current).
    sync.hset(ended.job.key, "status", "finished")
    sync.zadd(registry, {ended.execution.composite_key: time.time() - 60})
    assert await _sweep(bridge) == []
    assert _queued(sync, ended.queue.key) == []
    assert sync.zscore(registry, ended.execution.composite_key) is None  # tidied
    assert sync.zscore(registry, live.execution.composite_key) is not None
    assert sync.hget(live.job.key, "status") == b"started"


async def test_under_redis_oom_a_requeue_or_a_sweep_writes_nothing(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    # On a real redis-server out of memory (maxmemory, noeviction): a worker's requeue is one
    # MULTI, refused whole (Redis refuses every command queued in a MULTI then), so the job
    # stays started by it and its bookkeeping retries (already so before); the sweep's move is
    # one script whose first write is refused, so the lapsed job stays where it is.
    await client.submit([f.request(4) for _ in range(2)])
    mine, lapsed = await bridge.dequeue_many(1, 2)
    queue = mine.queue
    sync.zadd(queue.started_job_registry.key, {lapsed.execution.composite_key: time.time() - 60})
    async with out_of_memory(client.store.redis):
        with pytest.raises(OutOfMemoryError):
            await bridge.requeue(mine, at_front=True)
        assert await _sweep(bridge) == []
        assert _queued(sync, queue.key) == []
        for t in (mine, lapsed):  # both still started, where a retry finds them
            assert sync.zscore(queue.started_job_registry.key, t.execution.composite_key)
            assert sync.hget(t.job.key, "status") == b"started"
    await bridge.requeue(mine, at_front=True)
    await asyncio.sleep(defaults.REAP_RETRY_S + 0.2)
    assert await _sweep(bridge) == [lapsed.job.id]
    assert sorted(_queued(sync, queue.key)) == sorted([mine.job.id, lapsed.job.id])


# -- a worker giving its job back ---------------------------------------------------------------


def _fail_the_first_give_back(
    monkeypatch: pytest.MonkeyPatch, sync: Redis, key: str, for_s: float = 0.5
) -> list[float]:
    """At the worker's first give back, the queue ``key`` is damaged for ``for_s`` seconds
    (its rq bookkeeping retries after 1 s): returns when that happened, once it has."""
    real = RqBridge.requeue
    when: list[float] = []

    async def requeue(self: RqBridge, r: TakenJob, **kw: Any) -> None:
        if not when:
            when.append(time.monotonic())
            _damage(sync, key)
            asyncio.get_running_loop().call_later(for_s, sync.delete, key)
        await real(self, r, **kw)

    monkeypatch.setattr(RqBridge, "requeue", requeue)
    return when


async def _generating(client: RolloutClient, rid: str, tokens: int = 8) -> None:
    async def saved() -> bool:
        return (await client.store.load(rid)).num_tokens >= tokens

    await until(saved, timeout=30, what="no tokens saved")


PACED = {"tokens_per_chunk": 1, "token_delay_s": 0.005}


@pytest.mark.parametrize("why", ["shutdown", "weight_update", "engine_error"])
async def test_a_job_whose_give_back_failed_once_is_given_back_and_its_rollout_finishes(
    server: RedisServer,
    sync: Redis,
    client: RolloutClient,
    monkeypatch: pytest.MonkeyPatch,
    why: str,
) -> None:
    # Before: the runner dropped the lease, then rq.requeue's MULTI ran the execution's cleanup
    # but not its push (a command failing inside a MULTI does not undo the others): the retry
    # found the job no longer started by it and did nothing. The rollout stayed aborted with no
    # lease and no job, forever.
    prompt = (1, 7, 2) if why == "engine_error" else (1, 2, 3)  # 7: the engine's poison
    [rid] = await client.submit([f.request(400, prompt=prompt)])
    queue_key = rollout_queue(sync).key
    failed = _fail_the_first_give_back(monkeypatch, sync, queue_key)
    first = Worker(
        WorkerConfig(redis_url=server.url, name="first", max_engine_attempts=2),
        SyntheticEngine(poison_token=7 if why == "engine_error" else None, **PACED),
    )
    task = asyncio.create_task(first.run())
    rescuer = None
    try:
        if why != "engine_error":  # which ends its attempt at once
            await _generating(client, rid)
        if why == "shutdown":
            first.request_stop()
            await asyncio.wait_for(task, 30)
            # The next worker finds the job on the queue and finishes the rollout.
            rescuer = Worker(WorkerConfig(redis_url=server.url, name="rescuer", burst=True),
                             SyntheticEngine())  # fmt: skip
            await asyncio.wait_for(rescuer.run(), 60)
        elif why == "weight_update":
            await client.publish_weights(1, "/weights/v1")
        [result] = await client.wait([rid], timeout=30)
    finally:
        first.request_stop()
        await asyncio.wait_for(task, 30)
    assert failed, "the give back was never tried"
    events = await client.store.events(rid)
    aborts = [e.reason for e in events if isinstance(e, Aborted)]
    if why == "engine_error":
        # Two engine errors (its budget): the second time it fails; both were given back
        # through the damaged then repaired queue.
        assert result.status is Status.FAILED
        assert aborts == [AbortReason.ENGINE_ERROR] * 2
    else:
        assert result.status is Status.DONE and len(result.response_token_ids) == 400
        assert aborts == [AbortReason(why)]
    assert sync.llen(queue_key) == 0


async def test_a_give_back_that_raises_once_is_retried_and_its_rollout_finishes(
    server: RedisServer, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Already right before: a failure that writes nothing (a dropped connection, a MULTI
    # refused whole under Redis OOM) leaves the job started by this worker and heartbeated,
    # and the worker's bookkeeping retries it with backoff (JobEndings.books).
    [rid] = await client.submit([f.request(400)])
    real = RqBridge.requeue
    raised: list[str] = []

    async def requeue(self: RqBridge, r: TakenJob, **kw: Any) -> None:
        if not raised:
            raised.append(r.job.id)
            raise RedisConnectionError("connection reset by peer")
        await real(self, r, **kw)

    monkeypatch.setattr(RqBridge, "requeue", requeue)
    worker = Worker(WorkerConfig(redis_url=server.url, name="w"), SyntheticEngine(**PACED))
    task = asyncio.create_task(worker.run())
    try:
        await _generating(client, rid)
        await client.publish_weights(1, "/weights/v1")
        [result] = await client.wait([rid], timeout=30)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
    assert raised
    assert result.status is Status.DONE and len(result.response_token_ids) == 400
