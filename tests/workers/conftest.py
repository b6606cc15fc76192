"""Fixtures of the worker tests: each test gets a redis-server of its own (they kill it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from store.redis_server import RedisServer
from tests.vllm_plugin import release_vllm


@pytest_asyncio.fixture(scope="package", loop_scope="session", autouse=True)
async def _no_idle_vllm_engines() -> None:
    """The engine tests' pooled vLLM engines and servers are stopped before the worker tests:
    idle, they still poll, and these tests time real processes on 2 cores."""
    await release_vllm()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s
