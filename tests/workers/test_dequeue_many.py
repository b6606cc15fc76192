"""A worker takes several queued jobs in one dequeue (``RqBridge.dequeue_many``), each exactly
as rq's own one-at-a-time dequeue and start would leave it.

Why it exists: one job per dequeue cost a worker ~20 ms per rollout (thread hops, and a GIL wait
of up to the switch interval after each reply while the event loop was busy), so at 256 slots a
burst worker never had more than ~14 rollouts running (bench/bench_overhead.py, gpu_cadence).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis import Redis
from rq.job import JobStatus

from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from workers.rq_bridge import RqBridge

pytestmark = pytest.mark.redis_server


async def _submit(server: RedisServer, n: int) -> list[str]:
    client = RolloutClient(server.url)
    try:
        return await client.submit([f.request(4) for _ in range(n)])
    finally:
        await client.aclose()


async def test_several_jobs_in_one_call_each_started_as_rq_starts_one(
    server: RedisServer, sync: Redis, bridge: RqBridge
) -> None:
    ids = await _submit(server, 5)
    first = await bridge.dequeue_many(1, 3)
    assert [t.rollout_id for t in first] == ids[:3]  # in queue order
    rest = await bridge.dequeue_many(1, 10)  # more asked than queued: what there is
    assert [t.rollout_id for t in rest] == ids[3:]
    assert await bridge.dequeue_many(1, 4) == []  # empty: after the blocking wait
    taken = first + rest
    queue = taken[0].queue
    assert sync.llen(queue.key) == 0
    assert sync.llen(queue.intermediate_queue_key) == 0  # none left "in transit"
    started = set(queue.started_job_registry.get_job_ids())
    for t in taken:
        assert t.problem is None
        t.job.refresh()
        assert t.job.get_status() == JobStatus.STARTED
        assert t.job.worker_name == "w1"
        assert sync.ttl(t.job.key) == -1  # persisted while it runs
        assert t.job.id in started
        assert t.execution.id in bridge.running
    assert len(bridge.worker.executions) == 5


async def test_a_job_whose_hash_is_gone_is_skipped_and_the_rest_are_taken(
    server: RedisServer, sync: Redis, bridge: RqBridge
) -> None:
    ids = await _submit(server, 4)
    queue = bridge.queues[0]
    job_ids = [j.decode() for j in sync.lrange(queue.key, 0, -1)]
    sync.delete(f"rq:job:{job_ids[2]}")  # as an ack racing the dequeue would
    taken = await bridge.dequeue_many(1, 4)
    assert [t.rollout_id for t in taken] == [ids[0], ids[1], ids[3]]
    assert sync.llen(queue.key) == 0


async def test_a_malformed_job_hash_is_dropped_and_the_rest_are_taken(
    server: RedisServer, sync: Redis, bridge: RqBridge
) -> None:
    """A hash with no payload (the 30-minute soak met one: its fields written back after the
    job was deleted) made rq's fetch raise for the whole batch, every turn, on every worker:
    the fleet took no job. Now it is deleted and taken off the intermediate list."""
    ids = await _submit(server, 3)
    queue = bridge.queues[0]
    job_ids = [j.decode() for j in sync.lrange(queue.key, 0, -1)]
    sync.delete(f"rq:job:{job_ids[1]}")
    sync.hset(f"rq:job:{job_ids[1]}", mapping={"last_heartbeat": "x", "status": "queued",
                                                "enqueued_at": "y"})  # fmt: skip
    taken = await bridge.dequeue_many(1, 4)
    assert [t.rollout_id for t in taken] == [ids[0], ids[2]]
    assert not sync.exists(f"rq:job:{job_ids[1]}")
    assert job_ids[1].encode() not in sync.lrange(queue.intermediate_queue_key, 0, -1)


async def test_a_job_that_is_not_ours_comes_with_its_problem_beside_good_ones(
    server: RedisServer, bridge: RqBridge
) -> None:
    ids = await _submit(server, 1)
    bridge.queues[0].enqueue("os.getcwd")  # anyone who can write to Redis can enqueue anything
    taken = await bridge.dequeue_many(1, 4)
    assert [t.rollout_id for t in taken] == [ids[0], ""]
    assert taken[0].problem is None
    assert taken[1].problem is not None


async def test_the_blocking_wait_still_ends_on_the_first_job(
    server: RedisServer, bridge: RqBridge
) -> None:
    started = time.monotonic()
    call = asyncio.create_task(bridge.dequeue_many(5, 8))
    await asyncio.sleep(0.3)
    ids = await _submit(server, 1)
    taken = await call
    assert [t.rollout_id for t in taken] == ids
    assert time.monotonic() - started < 3  # woke on the job, not at the 5 s timeout


async def test_a_job_woken_for_alone_is_taken_without_asking_for_more(
    server: RedisServer, bridge: RqBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocking pop reads the queue's length in its own round trip: a job that came alone
    (an episode's next turn, pushed by its tool's result) is taken in two round trips, the pop
    and its hash, not three; jobs that came together are all taken, as before."""
    from workers import rq_bridge

    asked: list[int] = []
    real = rq_bridge.pop_share

    def counted(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        asked.append(len(found))
        return found

    monkeypatch.setattr(rq_bridge, "pop_share", counted)
    call = asyncio.create_task(bridge.dequeue_many(5, 8))
    await asyncio.sleep(0.3)
    assert asked == [0]  # the look before blocking: empty
    [rid] = await _submit(server, 1)
    assert [t.rollout_id for t in await call] == [rid] and asked == [0]
    call = asyncio.create_task(bridge.dequeue_many(5, 8))
    await asyncio.sleep(0.3)
    two = await _submit(server, 2)  # one transaction: the pop finds one more behind it
    assert [t.rollout_id for t in await call] == two and asked == [0, 0, 1]


async def test_a_worker_with_free_slots_takes_queued_jobs_in_few_dequeues(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 queued rollouts and 64 slots: a handful of dequeues, not one per job (each one
    costs the worker its thread hops; see the module docstring). Counted at the dequeue
    thread's ``RqBridge._take``, which every way of taking jobs goes through."""
    from workers.engines.synthetic import SyntheticEngine
    from workers.worker import Worker, WorkerConfig

    ids = await _submit(server, 64)
    got: list[bool] = []
    real = RqBridge._take

    def counted(self: RqBridge, *args: Any, **kwargs: Any) -> Any:
        found = real(self, *args, **kwargs)
        got.append(bool(found))
        return found

    monkeypatch.setattr(RqBridge, "_take", counted)
    engine = SyntheticEngine(tokens_per_chunk=1, token_delay_s=0.01)  # 4 tokens: ~40 ms
    config = WorkerConfig(redis_url=server.url, burst=True, max_concurrency=64)
    await Worker(config, engine).run()
    client = RolloutClient(server.url)
    try:
        assert {r.status.value for r in await client.wait(ids, timeout=30)} == {"done"}
    finally:
        await client.aclose()
    # Before: 64, one per job.
    assert 1 <= sum(got) <= 2, got


async def test_beside_another_worker_on_the_queue_a_worker_takes_its_share(
    server: RedisServer,
) -> None:
    """Two workers on one queue, 21 jobs: the first to wake takes its half of them, rounded
    up, not all of them (it would run a short queue alone while the other idles)."""
    await _submit(server, 21)
    one = RqBridge(server.url, ["rollouts"], "w1")
    two = RqBridge(server.url, ["rollouts"], "w2")
    try:
        await one.register()
        await two.register()
        first = await one.dequeue_many(1, 100)
        assert len(first) == 11
        second = await two.dequeue_many(1, 100)
        assert len(second) == 5  # half of the 10 left
    finally:
        await one.close()
        await two.close()


async def test_jobs_taken_without_awaiting_their_start_are_started_before_anything_else(
    server: RedisServer, sync: Redis, bridge: RqBridge
) -> None:
    """``await_start=False`` (the worker's way): the jobs come back at once; rq's start is the
    bookkeeping thread's next call, so a heartbeat or an end queued after it finds them
    started, and nothing beats an execution before rq has it."""
    await _submit(server, 3)
    taken = await bridge.dequeue_many(1, 3, await_start=False)
    assert len(taken) == 3 and all(t.execution.id in bridge.running for t in taken)
    await bridge.heartbeat()  # queued behind the start: beats the started executions
    started = set(taken[0].queue.started_job_registry.get_job_ids())
    for t in taken:
        assert t.started and not t.ended
        t.job.refresh()
        assert t.job.get_status() == JobStatus.STARTED and t.job.id in started
    assert sync.llen(taken[0].queue.intermediate_queue_key) == 0


async def test_a_start_that_fails_leaves_the_jobs_to_the_sweep_and_not_ours(
    server: RedisServer, sync: Redis, bridge: RqBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis gone for rq's start: the jobs are not heartbeated nor ended as this worker's
    (rq never listed them), and they stay in rq's intermediate list, where the stuck-dequeue
    sweep finds them and gives them back."""
    await _submit(server, 2)

    def gone(*_: object) -> None:
        raise ConnectionError("redis went away")

    monkeypatch.setattr(bridge, "_start", gone)
    taken = await bridge.dequeue_many(1, 2, await_start=False)
    assert len(taken) == 2
    await bridge.heartbeat()  # after the failed start, on the same thread
    for t in taken:
        assert t.ended and not t.started and t.execution.id not in bridge.running
        t.job.refresh()
        assert t.job.get_status() == JobStatus.QUEUED  # rq never saw it start
    queue = taken[0].queue
    assert sync.zcard(queue.started_job_registry.key) == 0  # no heartbeat created an entry
    assert sync.llen(queue.intermediate_queue_key) == 2  # the sweep's to give back
