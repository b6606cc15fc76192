"""Shared fixtures: a real redis-server for the session, fakeredis, and the event store on both."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import fakeredis
import hypothesis
import pytest
import pytest_asyncio
import redis.asyncio as aredis
from fakeredis.commands_mixins import server_mixin

from store import EventStore
from store.redis_server import RedisServer
from tests import fakeredis_xsetid  # noqa: F401  (XSETID, which lua/append.lua uses)
from tests.engine_pool import EnginePool
from tests.engine_pool import cpu_pool as cpu_engine_pool

# The `vllm` marker, the vLLM environment redirect and the shared in-process engines.
pytest_plugins = ["tests.vllm_plugin"]

# No per-example deadline: the properties are about results, and on 2 cores shared with the
# suite's worker and vLLM processes an example's time says nothing (a CI run once failed a
# codec property on hypothesis's 200 ms default). Every other setting stays hypothesis's own.
hypothesis.settings.register_profile("rollouts", deadline=None)
hypothesis.settings.load_profile("rollouts")

# Tests never reach a model hub: everything they load is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen3 model with a locally trained tokenizer (no download)."""
    from workers.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "dense", moe=False, seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, Qwen3-MoE: 8 experts, top-2, 2 layers."""
    from workers.demo.tiny_model import make_tiny_model

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


@pytest.fixture
def host_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Set this host's wall clock (``time.time``) ``offset`` seconds away from the true one, as
    a host without NTP or stepped by it is; Redis's clock stays true. fakeredis answers TIME
    with ``time.time`` of its own module, which is kept on the true clock (a real Redis runs
    on a host of its own)."""
    real = time.time
    offset = [0.0]
    monkeypatch.setattr(server_mixin, "time", SimpleNamespace(time=real))
    monkeypatch.setattr(time, "time", lambda: real() + offset[0])

    def set_offset(seconds: float) -> None:
        offset[0] = seconds

    return set_offset
