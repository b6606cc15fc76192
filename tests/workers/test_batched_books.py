"""rq bookkeeping done for many jobs at once leaves each job exactly as rq's own one-job calls
would (real redis-server).

Why batched: one at a time, a job's success took ~7 round trips on the bookkeeping thread, and
the stuck-dequeue sweep 3 per job in transit; at GPU cadence (hundreds of rollouts ending
together) that was the largest part of a worker's CPU per rollout (bench_overhead's
gpu_cadence).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from redis import Redis
from rq import Queue
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from store.client import RolloutClient
from store.redis_server import RedisServer
from tests import factories as f
from workers.engines.synthetic import SyntheticEngine
from workers.outcomes import Outcome
from workers.rq_bridge import RqBridge
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


@pytest_asyncio.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


def _count_calls(monkeypatch: pytest.MonkeyPatch, bridge: RqBridge, name: str) -> list[int]:
    """The sizes of the batches ``bridge.<name>`` was called with."""
    real = getattr(bridge, name)
    sizes: list[int] = []

    def counted(items: list[Any]) -> Any:
        sizes.append(len(items))
        return real(items)

    monkeypatch.setattr(bridge, name, counted)
    return sizes


async def test_successes_made_together_are_recorded_together_as_rq_records_one(
    sync: Redis, bridge: RqBridge, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.submit([f.request(4) for _ in range(6)])
    taken = await bridge.dequeue_many(1, 6)
    assert len(taken) == 6
    # The first job has a dependent, so rq's own handle_job_success records it (its WATCH on
    # the dependents is what a batch cannot do): the reference for the batched five.
    other = Queue("other", connection=sync, serializer=JSONSerializer)
    dependent = other.enqueue_call("os.getpid", depends_on=taken[0].job.id)
    assert dependent.get_status() == JobStatus.DEFERRED
    batches = _count_calls(monkeypatch, bridge, "_record_successes")

    await asyncio.gather(*(bridge.succeed(t, {"n": i}) for i, t in enumerate(taken)))

    assert batches == [6]  # one bookkeeping call for the six
    queue = taken[0].queue
    assert queue.started_job_registry.get_job_ids() == []
    assert sorted(queue.finished_job_registry.get_job_ids()) == sorted(t.job.id for t in taken)
    assert bridge.running == {} and bridge.worker.executions == {}
    assert all(t.ended for t in taken)
    reference = sync.hgetall(taken[0].job.key)
    for i, t in enumerate(taken):
        job = Job.fetch(t.job.id, connection=sync, serializer=JSONSerializer)
        assert job.get_status() == JobStatus.FINISHED
        assert job.return_value() == {"n": i}
        latest = Result.fetch_latest(job, serializer=JSONSerializer)
        assert latest is not None and latest.type == Result.Type.SUCCESSFUL
        assert latest.execution_id == t.execution.id
        assert set(sync.hgetall(t.job.key)) == set(reference)  # the same fields as rq's
        assert 0 < sync.ttl(t.job.key) <= sync.ttl(taken[0].job.key) + 5
        assert not sync.exists(t.execution.key)
    worker = sync.hgetall(bridge.worker.key)
    assert int(worker[b"successful_job_count"]) == 6
    assert dependent.get_status(refresh=True) == JobStatus.QUEUED  # rq moved it on
    assert sync.lrange(other.key, 0, -1) == [dependent.id.encode()]


async def test_an_acknowledged_rollouts_job_is_deleted_and_the_others_are_kept(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    ids = await client.submit([f.request(4) for _ in range(3)])
    taken = await bridge.dequeue_many(1, 3)
    # Acknowledged before its success is recorded (ack deletes the rollout and its job).
    sync.delete(client.store.keys.snapshot(ids[1]))
    await asyncio.gather(*(bridge.succeed(t, {}) for t in taken))
    assert sync.exists(taken[0].job.key) and sync.exists(taken[2].job.key)
    assert not sync.exists(taken[1].job.key)
    assert not sync.exists(Result.get_key(taken[1].job.id))
    assert taken[1].job.id not in taken[1].queue.finished_job_registry.get_job_ids()


async def test_a_job_no_longer_ours_is_left_as_rq_has_it(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    await client.submit([f.request(4) for _ in range(3)])
    taken = await bridge.dequeue_many(1, 3)
    # Canceled by someone else meanwhile: rq's verdict stands; the others succeed.
    sync.hset(taken[1].job.key, "status", JobStatus.CANCELED.value)
    await asyncio.gather(*(bridge.succeed(t, {}) for t in taken))
    statuses = [sync.hget(t.job.key, "status") for t in taken]
    assert statuses == [b"finished", b"canceled", b"finished"]
    assert bridge.running == {}


async def test_the_stuck_dequeue_sweep_acts_per_job_in_one_pass(
    sync: Redis, bridge: RqBridge, client: RolloutClient
) -> None:
    ids = await client.submit([f.request(4) for _ in range(4)])
    queue = bridge.queues[0]
    jobs = [i.decode() for i in sync.lrange(queue.key, 0, -1)]
    assert len(jobs) == 4
    # All four popped into rq's intermediate list by a worker that then died, as it would.
    for _ in jobs:
        sync.lmove(queue.key, queue.intermediate_queue_key)
    gone, old, fresh, started = jobs
    sync.delete(Job.key_for(gone))  # acknowledged meanwhile
    inter = IntermediateQueue(queue.key, connection=sync)
    sync.set(inter.get_first_seen_key(old), time.time() - 3600)  # seen stuck an hour ago
    # Live on another worker: its execution is in the started registry (job id:execution id).
    sync.zadd(queue.started_job_registry.key, {f"{started}:e1": time.time() + 60})

    requeued = await bridge.requeue_abandoned()

    assert requeued == [old]
    assert [i.decode() for i in sync.lrange(queue.key, 0, -1)] == [old]  # at the front
    assert [i.decode() for i in sync.lrange(queue.intermediate_queue_key, 0, -1)] == [
        fresh,
        started,
    ]
    assert sync.exists(inter.get_first_seen_key(fresh))  # seen now: its clock starts
    assert not sync.exists(inter.get_first_seen_key(started))
    assert len(ids) == 4


async def test_a_worker_starting_many_rollouts_at_once_opens_few_connections(
    server: RedisServer, sync: Redis, client: RolloutClient
) -> None:
    # Before: each rollout's first load, lease and lease drop was a round trip of its own,
    # and the asyncio client's pool grew a connection per rollout running them at once (64
    # here, 256 at GPU cadence), each costing a connect, a handshake and redis-py's setup.
    await client.submit([f.request(32) for _ in range(64)])
    before = int(sync.info("stats")["total_connections_received"])
    worker = Worker(
        WorkerConfig(redis_url=server.url, max_concurrency=64, burst=True),
        SyntheticEngine(tokens_per_chunk=1),
    )
    await asyncio.wait_for(worker.run(), 60)
    opened = int(sync.info("stats")["total_connections_received"]) - before
    assert worker.stats.outcomes.get(Outcome.FINISHED) == 64
    assert opened <= 16, opened
