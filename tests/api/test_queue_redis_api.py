"""``rollouts api --queue-redis``: the API's client submits, acknowledges and counts with rq's
queue on a Redis of its own (store/queue_redis.py). The store on db 0 and the queue on db 1
of one redis-server: a step on the wrong Redis finds nothing there."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer
from rq.job import Job
from rq.serializers import JSONSerializer

from store.api.app import make_app
from store.client import RolloutClient
from store.redis_server import RedisServer, free_port
from tests.api.test_process import api_command, wait_healthy
from tests.store.trainer import finish

BODY = {"prompts": [{"prompt_token_ids": [11, 12, 13]}], "n": 2,
        "sampling": {"max_tokens": 4}, "batch_id": "q"}  # fmt: skip


def _db(server: RedisServer, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
async def dbs(api_redis: RedisServer) -> AsyncIterator[tuple[aredis.Redis, aredis.Redis]]:
    store = aredis.Redis.from_url(_db(api_redis, 0))
    queue = aredis.Redis.from_url(_db(api_redis, 1))
    await store.flushall()
    yield store, queue
    await store.aclose()
    await queue.aclose()


async def test_submit_ack_and_stats_with_the_queue_apart(
    api_redis: RedisServer, dbs: tuple[aredis.Redis, aredis.Redis]
) -> None:
    store, queue = dbs
    client = RolloutClient(_db(api_redis, 0), queue_url=_db(api_redis, 1))
    api = TestClient(TestServer(make_app(client)))
    await api.start_server()
    try:
        r = await api.post("/v1/batches", json=BODY)
        assert r.status == 200, await r.text()
        done, pending = (await r.json())["ids"]
        stats = await (await api.get("/v1/stats")).json()
        assert stats["queues"] == {"rollouts": 2}
        assert await store.keys("rq:*") == [] and len(await queue.keys("rq:job:*")) == 2
        await finish(client.store, done)
        r = await api.post("/v1/ack", json={"ids": [done, pending]})
        assert (await r.json())["acked"] == [done]
        [left] = await queue.keys("rq:job:*")
        job = Job.fetch(left.decode().split(":")[-1], connection=client.sync_redis,
                        serializer=JSONSerializer)  # fmt: skip
        assert job.kwargs == {"rollout_id": pending}
        assert not await store.exists(client.keys.snapshot(done))
    finally:
        await api.close()
        await client.aclose()


def test_a_cluster_queue_is_refused_in_one_line() -> None:
    command = api_command("redis://127.0.0.1:6379/0", free_port(),
                          "--queue-redis", "redis+cluster://127.0.0.1:7000")  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert done.stderr.startswith("rollouts api: error: rq's queue runs on one Redis")


async def test_a_real_api_process_enqueues_on_its_queue_redis(
    api_redis: RedisServer, dbs: tuple[aredis.Redis, aredis.Redis], tmp_path: Path
) -> None:
    store, queue = dbs
    port = free_port()
    log = tmp_path / "api.log"
    api = subprocess.Popen(api_command(_db(api_redis, 0), port, "--queue-redis",
                                       _db(api_redis, 1)),
                           stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(base, api, log)
        async with (
            aiohttp.ClientSession(base_url=base) as http,
            http.post("/v1/batches", json=BODY) as r,
        ):
            assert r.status == 200, await r.text()
            ids = (await r.json())["ids"]
        jobs = await queue.lrange("rq:queue:rollouts", 0, -1)
        assert len(jobs) == len(ids) == 2
        assert await store.keys("rq:*") == []
    finally:
        api.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(api.wait, 30)
    assert code == 0, log.read_text()
