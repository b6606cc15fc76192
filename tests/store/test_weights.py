"""The weight-version registry, on fakeredis and a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from store.weights import StaleWeightVersion, WeightRegistry


async def test_versions_only_go_up_and_refusals_change_nothing(
    redis_client: aredis.Redis,
) -> None:
    reg = WeightRegistry(redis_client)
    assert await reg.latest() is None
    await reg.publish(1, "/ckpt/1")
    await reg.publish(5, "/ckpt/5")
    before = await reg.history()
    for bad in (5, 4, 1):
        with pytest.raises(StaleWeightVersion, match="not above the latest published \\(5\\)"):
            await reg.publish(bad, "/ckpt/old")
    for bad in (0, -1, True):
        with pytest.raises(StaleWeightVersion):
            await reg.publish(bad, "/ckpt/x")  # type: ignore[arg-type]
    assert await reg.history() == before
    latest = await reg.latest()
    assert latest is not None and (latest.version, latest.path) == (5, "/ckpt/5")


async def test_waiters_are_woken_by_a_publish_not_by_polling(redis_client: aredis.Redis) -> None:
    reg = WeightRegistry(redis_client)
    await reg.publish(2, "/a")
    assert await reg.wait_newer(2, 0.05) is None  # nothing newer: times out
    waiter = asyncio.create_task(reg.wait_newer(2, 10))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await reg.publish(3, "/b")
    got = await asyncio.wait_for(waiter, 2)
    assert got is not None and got.version == 3
    # A worker that was behind by several versions is told the newest at once.
    await reg.publish(4, "/c")
    await reg.publish(9, "/d")
    newest = await reg.wait_newer(3, 1)
    assert newest is not None and newest.version == 9
