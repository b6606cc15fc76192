"""Workers in the stats: a real worker process publishes its heartbeat (in-flight count,
weights, queues, model) and removes it on SIGTERM; a reaper prunes a dead worker's entry."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import fakeredis
import pytest

from statemachine import RolloutRequest
from store import EventStore
from store.client import RolloutClient
from store.leases import Leases
from store.redis_server import RedisServer
from store.stats import WorkerBeat, beat, read_stats
from tests.workers.helpers import SYNTHETIC, greedy, start_worker, stop, until
from workers.reaper import Reaper


@pytest.mark.redis_server
async def test_a_worker_process_shows_in_the_stats_until_it_stops(
    server: RedisServer, tmp_path: Path
) -> None:
    client = RolloutClient(server.url)
    requests = [RolloutRequest(prompt_token_ids=(i, 2, 3), sampling=greedy(4000)) for i in (1, 2)]
    await client.submit(requests)
    worker = start_worker(
        server.url, SYNTHETIC, "ws", tmp_path / "ws.log", "--weight-version", "7", concurrency=3
    )
    try:

        async def both_running() -> bool:
            return any(w.in_flight == 2 for w in (await client.stats()).workers)

        await until(both_running, 60, "the worker never showed 2 rollouts in flight")
        stats = await client.stats()
        [w] = stats.workers
        assert (w.worker_id, w.weight_version, w.queues) == ("ws", 7, ("rollouts",))
        assert w.model.startswith("synthetic:") and 0 <= w.age_s(stats.now) < 3
        stop(worker)
        assert worker.returncode == 0
        # Gone at once (not after the staleness window): the worker removed its own entry.
        assert (await client.stats()).workers == []
        assert await client.redis.hlen(client.keys.workers()) == 0
    finally:
        stop(worker)
    await client.aclose()


async def test_the_reaper_prunes_the_heartbeats_of_dead_workers() -> None:
    server = fakeredis.FakeServer()
    redis = fakeredis.FakeAsyncRedis(server=server)
    store = EventStore(redis)
    keys = store.keys
    await beat(redis, keys, WorkerBeat("killed", 2, 1, ("rollouts",), "m", at=time.time() - 60))
    await beat(redis, keys, WorkerBeat("alive", 1, 1, ("rollouts",), "m"))
    reaper = Reaper(store, Leases(redis), fakeredis.FakeRedis(server=server))
    stop_event = asyncio.Event()
    task = asyncio.create_task(reaper.run(0.01, stop_event))

    async def pruned() -> bool:
        return not await redis.hexists(keys.workers(), "killed")

    await until(pruned, 5, "the dead worker's heartbeat was not pruned")
    stop_event.set()
    await task
    assert [w.worker_id for w in (await read_stats(redis, keys)).workers] == ["alive"]
    await redis.aclose()
