"""Fixtures of the worker tests: each test gets a redis-server of its own (they kill it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from redis import Redis

from store.redis_server import RedisServer
from tests.vllm_plugin import release_vllm
from workers.rq_bridge import RqBridge


@pytest_asyncio.fixture(scope="package", loop_scope="session", autouse=True)
async def _no_idle_vllm_engines() -> None:
    """The engine tests' pooled vLLM engines and servers are stopped before the worker tests:
    idle, they still poll, and these tests time real processes on 2 cores."""
    await release_vllm()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s


@pytest.fixture
def sync(server: RedisServer) -> Iterator[Redis]:
    """A synchronous client of the test's server (what rq uses)."""
    r = Redis.from_url(server.url)
    yield r
    r.close()


@pytest_asyncio.fixture
async def bridge(server: RedisServer) -> AsyncIterator[RqBridge]:
    """A registered rq bridge of worker "w1" on the default queue."""
    b = RqBridge(server.url, ["rollouts"], "w1")
    await b.register()
    yield b
    await b.close()
