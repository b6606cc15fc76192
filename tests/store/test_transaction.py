"""``store.scripts.transaction``: steps in one MULTI/EXEC, read back as redis-py's transaction
pipeline reads them (on fakeredis, and on a real redis-server, where the QUEUED replies are
read straight from the connection's parser under one deadline)."""

from __future__ import annotations

import pytest
import redis.asyncio as aredis
from redis.exceptions import ResponseError

from store import scripts


async def test_one_reply_per_step_in_order_and_an_error_in_its_place(
    redis_client: aredis.Redis,
) -> None:
    await redis_client.set("text", "not a number")
    steps = [("SET", "a", "1"), ("INCR", "text"), ("INCR", "a"), ("GET", "a")]
    replies = await scripts.transaction(redis_client, steps * 50)  # many QUEUED replies
    for k in range(50):
        ok, refused, incremented, got = replies[4 * k : 4 * k + 4]
        assert ok is True or ok == b"OK"
        assert isinstance(refused, ResponseError)  # EXEC ran the rest all the same
        assert incremented == 2
        assert got == b"2"


async def test_a_step_refused_when_queued_aborts_the_transaction_and_says_why(
    redis_client: aredis.Redis,
) -> None:
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await scripts.transaction(redis_client, [("SET", "a", "1"), ("SET", "b")])
    assert await redis_client.get("a") is None  # nothing of it ran
    # The connection is still good for the next one.
    assert await scripts.transaction(redis_client, [("INCR", "n")]) == [1]
