"""Lua scripts, read from ``store/lua/*.lua`` once per process and registered once per client."""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript


@cache
def script_text(name: str) -> str:
    return resources.files("store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def register(client: Redis, name: str) -> AsyncScript:
    """An EVALSHA wrapper that loads the script on first use (and again after a server restart
    dropped the script cache: redis-py retries NOSCRIPT with SCRIPT LOAD)."""
    return client.register_script(script_text(name))
