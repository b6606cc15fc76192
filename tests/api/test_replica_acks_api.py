"""``rollouts api --min-replicas-acked N`` (``RolloutClient(min_replicas_acked=N)``): a submit,
a cancel, an ack or a weight version counts as done once N replicas of Redis hold it. With
no replica to confirm it, the call is a 503 ``noreplicas`` (the Python client raises
``ReplicasNotAcked``, a ``StoreUnwritable``) and the same call succeeds once a replica is
back: retried as it was, it changes nothing twice (real redis-servers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer

from statemachine import RolloutRequest, SamplingParams
from store.api.app import make_app
from store.client import RolloutClient
from store.errors import ReplicasNotAcked, StoreUnwritable
from store.redis_server import RedisServer

pytestmark = pytest.mark.redis_server
T = TypeVar("T")


def submit(batch_id: str) -> dict[str, Any]:
    return {"prompts": [{"prompt_token_ids": [5, 6, 7]}], "n": 2, "batch_id": batch_id,
            "sampling": {"max_tokens": 8}}  # fmt: skip


class Pair:
    """A master and a spare server that becomes its replica on ``attach()``."""

    def __init__(self, tmp_path: Path) -> None:
        self.master = RedisServer(tmp_path / "master").start()
        self.spare = RedisServer(tmp_path / "spare").start()
        self.replica = aredis.Redis.from_url(self.spare.url)

    async def attach(self, timeout: float = 20.0) -> None:
        await self.replica.execute_command("REPLICAOF", "127.0.0.1", str(self.master.port))
        deadline = time.monotonic() + timeout
        while (await self.replica.info("replication")).get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced"
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.replica.aclose()
        # Killed: a master shutting down waits for its replicas to catch up, up to 10 s.
        for server in (self.spare, self.master):
            server.stop(kill=True)
            server.close()


async def retried(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, made again while the replica lags past WAIT's second (a loaded machine):
    what the error asks of a trainer."""
    for _ in range(10):
        try:
            return await call()
        except ReplicasNotAcked:
            continue
    raise AssertionError("never confirmed")


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    p = Pair(tmp_path)
    yield p
    await p.close()


async def test_the_client_confirms_every_write_on_a_replica(pair: Pair) -> None:
    client = RolloutClient(pair.master.url, min_replicas_acked=1)
    prompts = [RolloutRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=8))]
    with pytest.raises(ReplicasNotAcked) as short:
        await client.submit(prompts, n=2, batch_id="b1")
    assert isinstance(short.value, StoreUnwritable) and short.value.acked == 0
    await pair.attach()
    batch = await retried(lambda: client.submit(prompts, n=2, batch_id="b1"))  # the same call
    assert list(batch) == ["b1.0.0", "b1.0.1"]
    # What the master acknowledged, its replica holds.
    replica_keys = {k async for k in pair.replica.scan_iter(match="dr:*")}
    assert {b"dr:{b1.0.0}:snap", b"dr:{b1.0.1}:log", b"dr:batch:{b1}"} <= replica_keys
    assert await retried(lambda: client.cancel(batch_id="b1")) == ["b1.0.0", "b1.0.1"]
    assert (await retried(lambda: client.ack(batch_id="b1"))).acked == ["b1.0.0", "b1.0.1"]
    await retried(lambda: client.publish_weights(1, "/ckpt/1"))
    await client.aclose()


async def test_the_api_answers_503_noreplicas_until_a_replica_confirms(pair: Pair) -> None:
    client = RolloutClient(pair.master.url, min_replicas_acked=1)
    api = TestClient(TestServer(make_app(client)))
    await api.start_server()
    try:
        for path, body in (("/v1/batches", submit("b1")),
                           ("/v1/weights", {"version": 1, "path": "/ckpt/1"})):  # fmt: skip
            r = await api.post(path, json=body)
            assert r.status == 503, (path, r.status, await r.text())
            assert "Retry-After" in r.headers
            error = (await r.json())["error"]
            assert error["type"] == "store_unwritable", error
            assert "Redis refuses writes (noreplicas): 0 of 1 replicas" in error["message"]
        await pair.attach()
        r = await api.post("/v1/batches", json=submit("b1"))
        assert r.status == 200, await r.text()
        assert (await r.json())["ids"] == ["b1.0.0", "b1.0.1"]
        assert (await api.post("/v1/weights", json={"version": 1, "path": "/ckpt/1"})).status == 200
    finally:
        await api.close()
        await client.aclose()
