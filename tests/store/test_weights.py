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


INT64_MAX = 2**63 - 1


async def test_versions_compare_exactly_up_to_int64(redis_client: aredis.Redis) -> None:
    """Lua numbers are doubles: 2**53 + 1 read as one equals 2**53 (refused as not above
    it), and 2**63 - 1 came back as "9.2233720368548e+18", which no later publish could
    parse (every one a 500 over the API). The comparison is exact now."""
    reg = WeightRegistry(redis_client)
    await reg.publish(2**53, "/a")
    await reg.publish(2**53 + 1, "/b")  # above it by one: accepted
    with pytest.raises(StaleWeightVersion, match=rf"latest published \({2**53 + 1}\)"):
        await reg.publish(2**53 + 1, "/again")
    with pytest.raises(StaleWeightVersion, match=rf"latest published \({2**53 + 1}\)"):
        await reg.publish(2**53, "/older")
    await reg.publish(INT64_MAX - 1, "/c")
    await reg.publish(INT64_MAX, "/top")
    for older in (INT64_MAX, INT64_MAX - 1, 9, 10**18):
        with pytest.raises(StaleWeightVersion, match=rf"latest published \({INT64_MAX}\)"):
            await reg.publish(older, "/older")
    latest = await reg.latest()
    assert latest is not None and (latest.version, latest.path) == (INT64_MAX, "/top")
    assert [w.version for w in await reg.history()] == [2**53, 2**53 + 1, INT64_MAX - 1,
                                                        INT64_MAX]  # fmt: skip


async def test_a_version_beyond_int64_is_refused_and_writes_nothing(
    redis_client: aredis.Redis,
) -> None:
    """Token weight versions are int64 arrays: a larger version could never be recorded on a
    token, so it is refused by name (before: beyond 2**64 - 1 a Redis error; between, stored)."""
    reg = WeightRegistry(redis_client)
    await reg.publish(3, "/a")
    for big in (INT64_MAX + 1, 2**64 - 1, 2**64, 10**30):
        with pytest.raises(StaleWeightVersion, match="weight version must be an int in"):
            await reg.publish(big, "/big")
    assert [w.version for w in await reg.history()] == [3]


async def test_a_publish_retried_as_it_was_is_recognised(redis_client: aredis.Redis) -> None:
    """A trainer whose publish lost its reply (or whose replicas did not confirm it in time:
    ``--min-replicas-acked``) sends it again: the same version and path is that publish, not
    a stale one. Another path under the same version still is."""
    reg = WeightRegistry(redis_client)
    first = await reg.publish(3, "/ckpt/3")
    assert await reg.publish(3, "/ckpt/3") == first
    with pytest.raises(StaleWeightVersion, match="not above the latest published \\(3\\)"):
        await reg.publish(3, "/ckpt/other")
    await reg.publish(4, "/ckpt/4")
    with pytest.raises(StaleWeightVersion):
        await reg.publish(3, "/ckpt/3")  # an older one: only the latest is recognised
    assert [w.version for w in await reg.history()] == [3, 4]
