"""The net for rollouts left waiting with no job (workers/stranded.py), on a real redis-server:
it requeues them, and costs two round trips per check while nothing can be hidden."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from statemachine import Status
from store import EventStore
from store.client import RolloutClient
from store.event_store import JOB
from store.leases import Leases
from store.queue import rollout_queue
from store.redis_server import RedisServer
from tests import factories as f
from tests.store.trainer import checkpoint, start
from workers import stranded as stranded_module
from workers.engines.synthetic import SyntheticEngine
from workers.reaper import Reaper
from workers.stranded import StrandedSweep
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.redis_server


@pytest_asyncio.fixture
async def client(server: RedisServer) -> AsyncIterator[RolloutClient]:
    c = RolloutClient(server.url)
    yield c
    await c.aclose()


def _delete_job(sync: Redis, store: EventStore, rid: str) -> None:
    job_id = sync.hget(store.keys.snapshot(rid), JOB)
    assert job_id is not None
    Job.fetch(job_id.decode(), connection=sync, serializer=JSONSerializer).delete()


async def _aborted_with_no_job(client: RolloutClient, sync: Redis, rid: str) -> None:
    """``rid`` as the old reaper left it when its enqueue failed: aborted (worker_lost) with 8
    tokens saved, no lease, no job."""
    store = client.store
    _delete_job(sync, store, rid)  # the job its dead worker held, swept away
    s = await checkpoint(store, await start(store, rid, "ghost"), 8)
    await store.append(s, f.aborted(s))


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    real = stranded_module.find_stuck
    scans: list[int] = []

    async def find_stuck(*args: Any, **kw: Any) -> Any:
        scans.append(1)
        return await real(*args, **kw)

    monkeypatch.setattr(stranded_module, "find_stuck", find_stuck)
    return scans


async def test_a_rollout_left_waiting_with_no_job_is_requeued_and_finishes(
    server: RedisServer, sync: Redis, client: RolloutClient
) -> None:
    # Before: a rollout left aborted with no lease and no job (by the old reaper's failed
    # enqueue, a job deleted by hand, a write Redis lost) waited until an operator requeued it.
    ids = await client.submit([f.request(24) for _ in range(3)], ids=["a", "p", "ok"])
    await _aborted_with_no_job(client, sync, "a")
    _delete_job(sync, client.store, "p")  # pending, its job gone
    worker = Worker(
        WorkerConfig(redis_url=server.url, name="w", stranded_check_s=0.2),
        SyntheticEngine(),
    )
    task = asyncio.create_task(worker.run())
    try:
        results = await client.wait(ids, timeout=30)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
    assert [r.status for r in results] == [Status.DONE] * 3
    assert all(len(r.response_token_ids) == 24 for r in results)
    assert worker.reaper is not None and worker.reaper.stranded is not None
    assert worker.reaper.stranded.requeued == 2


async def test_a_check_costs_no_scan_while_every_waiting_rollout_has_a_job(
    sync: Redis, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.submit([f.request(8) for _ in range(5)])
    scans = _count_scans(monkeypatch)
    net = StrandedSweep(client.store, sync, check_s=0.05)
    assert await net.shortfall() == 0
    assert await net.check() == []
    assert scans == []


async def test_a_shortfall_it_cannot_act_on_is_looked_at_less_and_less_often(
    sync: Redis, client: RolloutClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dead worker's live rollout, its lease lapsed and its job gone: the reaper's to take
    # back, not this net's. Each look that requeues nothing doubles the wait before the next.
    store = client.store
    await client.submit([f.request(8)], ids=["live"])
    _delete_job(sync, store, "live")
    await checkpoint(store, await start(store, "live", "ghost"), 8)
    await Leases(store.redis).take("live", -10)
    scans = _count_scans(monkeypatch)
    net = StrandedSweep(store, sync, check_s=0.05, scan_max_s=0.4)
    waits = []
    for _ in range(4):
        await store.redis.delete(store.keys.stranded_check())
        await store.redis.hset(store.keys.stranded_scan(), "at", 0)  # due now
        assert await net.check() == []
        waits.append(float(await store.redis.hget(store.keys.stranded_scan(), "wait")))
    assert waits == [0.05, 0.1, 0.2, 0.4]
    assert len(scans) == 4
    # Not due: no look, however often it is checked.
    await store.redis.delete(store.keys.stranded_check())
    await store.redis.hset(store.keys.stranded_scan(), "at", 1e12)
    assert await net.check() == []
    assert len(scans) == 4
    # The reaper takes it back; with no shortfall left, the schedule starts over.
    assert await Reaper(store, Leases(store.redis), sync).reap_once() == ["live"]
    await store.redis.delete(store.keys.stranded_check())
    assert await net.check() == []
    assert not await store.redis.exists(store.keys.stranded_scan())
    assert rollout_queue(sync).count == 1


async def test_one_reaper_of_the_fleet_checks_per_interval(
    sync: Redis, client: RolloutClient
) -> None:
    [rid] = await client.submit([f.request(8)])
    _delete_job(sync, client.store, rid)
    nets = [StrandedSweep(client.store, sync, worker_id=f"w{i}", check_s=5) for i in range(3)]
    assert [await n.check() for n in nets] == [[rid], [], []]
    assert rollout_queue(sync).count == 1
