"""Fixtures of the API tests: a redis-server of this package's own (emptied before each test),
and the API app in-process (``aiohttp.test_utils``) over a real ``RolloutClient``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer

from store.api.app import make_app
from store.client import RolloutClient
from store.redis_server import RedisServer
from tests.api.env_helpers import env_api  # noqa: F401  (the environment routes' fixture)

MakeApi = Callable[..., Awaitable[TestClient]]


@pytest.fixture(scope="package")
def api_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Private to these tests, so they may flush it (appendfsync everysec: nothing here
    kills it, and the submit-heavy property run would wait on fsyncs otherwise)."""
    server = RedisServer(tmp_path_factory.mktemp("api-redis"), config={"appendfsync": "everysec"})
    server.start()
    yield server
    server.close()


@pytest.fixture
async def redis(api_redis: RedisServer) -> AsyncIterator[aredis.Redis]:
    r = aredis.Redis.from_url(api_redis.url)
    await r.flushall()
    yield r
    await r.aclose()


@pytest.fixture
async def trainer(api_redis: RedisServer, redis: aredis.Redis) -> AsyncIterator[RolloutClient]:
    """The Python client on the same server: what the tests check the API against."""
    c = RolloutClient(api_redis.url)
    yield c
    await c.aclose()


@pytest.fixture
async def make_api(api_redis: RedisServer, redis: aredis.Redis) -> AsyncIterator[MakeApi]:
    """``await make_api(token=..., max_body_bytes=...)``: a test client of a fresh app."""
    opened: list[tuple[TestClient, RolloutClient]] = []

    async def make(**kwargs: object) -> TestClient:
        rc = RolloutClient(api_redis.url)
        tc = TestClient(TestServer(make_app(rc, **kwargs)))  # type: ignore[arg-type]
        await tc.start_server()
        opened.append((tc, rc))
        return tc

    yield make
    for tc, rc in opened:
        await tc.close()
        await rc.aclose()


@pytest.fixture
async def api(make_api: MakeApi) -> TestClient:
    """The API without authentication."""
    return await make_api()
