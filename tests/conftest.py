"""Shared fixtures: a real redis-server for the session, fakeredis, and the event store on both."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fakeredis
import pytest
import pytest_asyncio
import redis.asyncio as aredis

from store import EventStore
from store.redis_server import RedisServer
from tests import fakeredis_xsetid  # noqa: F401  (XSETID, which lua/append.lua uses)
from tests.engine_pool import EnginePool
from tests.engine_pool import cpu_pool as cpu_engine_pool

# The `vllm` marker, the vLLM environment redirect and the shared in-process engines.
pytest_plugins = ["tests.vllm_plugin"]

# Tests never reach a model hub: everything they load is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen3 model with a locally trained tokenizer (no download)."""
    from workers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "dense", moe=False, seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, Qwen3-MoE: 8 experts, top-2, 2 layers."""
    from workers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "moe", moe=True, seed=0)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cpu_pool() -> AsyncIterator[EnginePool]:
    """CPU engines shared by the session's tests (`tests.engine_pool`)."""
    pool = cpu_engine_pool()
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of our own (free port, own data dir, AOF with fsync always)."""
    server = RedisServer(tmp_path_factory.mktemp("redis-session"))
    server.start()
    yield server
    server.close()


@pytest.fixture
async def real_redis(redis_server: RedisServer) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def fake_redis() -> AsyncIterator[aredis.Redis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


@pytest.fixture(params=["fakeredis", "redis-server"])
async def redis_client(request: pytest.FixtureRequest) -> AsyncIterator[aredis.Redis]:
    """The contract suites run once on fakeredis and once on a real redis-server."""
    if request.param == "fakeredis":
        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        client = aredis.Redis.from_url(server.url)
        await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
def store(redis_client: aredis.Redis) -> EventStore:
    return EventStore(redis_client)
