"""Fixtures of the worker tests: each test gets a redis-server of its own (they kill it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from store.server import RedisServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as s:
        yield s
