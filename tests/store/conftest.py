"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio as aredis

from store import EventStore
from store.client import RolloutClient
from store.environment import EnvironmentClient
from store.redis_server import RedisServer
from tests import factories as f


@pytest.fixture
async def client(
    redis_server: RedisServer, real_redis: aredis.Redis
) -> AsyncIterator[RolloutClient]:
    """A trainer client on the session's redis-server, emptied for the test (``real_redis``)."""
    c = RolloutClient(redis_server.url)
    yield c
    await c.aclose()


@pytest.fixture(params=["fakeredis", "redis-server"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[EnvironmentClient]:
    """An ``EnvironmentClient`` on fakeredis, then on the session's redis-server (emptied)."""
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        client: Any = fakeredis.FakeAsyncRedis(server=server)
        sync: Any = fakeredis.FakeRedis(server=server)
    else:
        real: RedisServer = request.getfixturevalue("redis_server")
        client = aredis.Redis.from_url(real.url)
        sync = redis.Redis.from_url(real.url)
        await client.flushall()
    yield EnvironmentClient(EventStore(client), sync, retries=1)
    await client.aclose()
    sync.close()


async def waiting(env: EnvironmentClient, rid: str = "ep", tool: str = "calc", **kw: Any) -> None:
    """An episode whose first turn ended at a call of ``tool``."""
    store = env.store
    s = await store.append(None, f.episode_submitted(rid, **kw))
    s = await store.append(s, f.started(s))
    s = await store.append(s, f.tokens(s, n=3))
    await store.append(s, f.requested(s, tool))


async def queued(env: EnvironmentClient, queue: str = "default") -> list[bytes]:
    return list(await env.store.redis.zrange(env.store.keys.env_queue(queue), 0, -1))


async def leased(env: EnvironmentClient) -> list[bytes]:
    return list(await env.store.redis.zrange(env.store.keys.tool_leases(), 0, -1))
