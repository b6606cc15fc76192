"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis

from store.client import RolloutClient
from store.redis_server import RedisServer


@pytest.fixture
async def client(
    redis_server: RedisServer, real_redis: aredis.Redis
) -> AsyncIterator[RolloutClient]:
    """A trainer client on the session's redis-server, emptied for the test (``real_redis``)."""
    c = RolloutClient(redis_server.url)
    yield c
    await c.aclose()
